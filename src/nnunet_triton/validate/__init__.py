"""``nnunet-triton validate``: the endpoint against nnU-Net or a recorded reference set, with a report.

compare     per-case, per-label Dice, voxel agreement, volume difference, probability difference
references  reference sets (record / against), checked for model, options, inputs and tampering
run         the loop over cases (errors per case, Ctrl-C -> interrupted), nnU-Net as the reference
report      validation.md / .html (matplotlib pictures, embedded) / .json
cli         the ``validate`` sub-command of ``nnunet-triton``
"""
