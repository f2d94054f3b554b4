"""Everything a user of the endpoint runs: the client, the CLI and image/DICOM input and output.

* ``client`` -- ``NnunetClient`` (HTTP/gRPC), ``endpoint`` -- the endpoint's description and retries
* ``predictor`` -- an ``nnUNetPredictor``-shaped facade; ``cli`` -- ``nnunet-triton``
* ``imageio`` -- NIfTI/NRRD/... cases; ``dicom`` -- DICOM series in, DICOM-SEG out

Never imports the server-side packages (``pipeline``, ``serving``, ``builder``, ``server``).
"""
