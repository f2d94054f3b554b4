"""Small helpers every part of the project shares, each with one home.

* :mod:`~nnunet_triton.util.durable`: atomic, durable file writes (temporary file in the same folder,
  fsync the file, rename, fsync the folder);
* :mod:`~nnunet_triton.util.process`: whether a process is alive;
* :mod:`~nnunet_triton.util.hashing`: the sha256 of a file;
* :mod:`~nnunet_triton.util.retry`: which Triton answers are worth retrying, and how long to wait.

Importable without Triton, torch or CuPy (standard library only).
"""
