"""The request pipeline behind the ``nnunet`` endpoint, independent of Triton's Python API.

* ``orchestration`` -- the BLS loop: tile batches fanned out to the fold models, merged per fold
* ``fold_runner`` -- the TorchScript fold as the Python-backend runner executes it

Imports ``numerics`` and the core modules only; ``serving`` connects it to ``pb_utils``.
"""
