"""The serving steps, in the order a request meets them: the Triton Python models of the pipeline.

    1. preprocess    IMAGE + SPACING -> PREPROCESSED + CASE_PROPERTIES            preprocess_model
    2. orchestrator  PREPROCESSED -> LOGITS: tiles fanned out to the folds (BLS)   orchestrator_model
    3. fold_runner   INPUT__0 -> OUTPUT__0: one fold's TorchScript network         fold_<k> (Python runner)
    4. stitch        LOGITS + CASE_PROPERTIES -> SEGMENTATION (+ PROBABILITIES)    stitch_model
    5. combine       PROBABILITIES_<i> -> SEGMENTATION (ensembles of configurations) combine_model

Each module defines its step on :class:`.base.Step` (the pb_utils lifecycle, once) and the
``TritonPythonModel`` Triton loads. The ``model.py`` of a repository's model is a few lines that import
that class (``nnunet_triton.builder.build_inputs.adapter_source``, written by the builder; the folders
``preprocess_model/``, ``repository/``, ``network_models/`` and ``stitch_model/`` of the source tree hold
the same files, for reading and for hand-made repositories).
"""

