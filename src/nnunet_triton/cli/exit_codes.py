"""The exit codes of ``nnunet-triton``: :mod:`nnunet_triton.exit_codes` (old import path)."""

from __future__ import annotations

from nnunet_triton.exit_codes import EPILOG, ExitCode

__all__ = ["EPILOG", "ExitCode"]
