"""Build ``pb_utils.InferenceResponse`` objects; the one place mapping our errors to Triton codes.

Every :class:`~nnunet_triton.errors.NnunetTritonError` names its ``triton_code`` (a plain string);
:func:`triton_error` turns it into ``pb_utils.TritonError(message, code)``.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from typing import Any

from nnunet_triton.errors import NnunetTritonError
from nnunet_triton.serving._pb import pb_utils
from nnunet_triton.serving.tensors import output_tensor

__all__ = [
    "triton_error",
    "ok_response",
    "error_response",
    "internal_error_response",
    "initialize_exception",
]

_FALLBACK_CODE = "INTERNAL"


def triton_error(exc: BaseException) -> Any:
    """Return ``pb_utils.TritonError`` for ``exc``: its ``triton_code`` for our errors, else INTERNAL."""
    pb = pb_utils()
    code_name = exc.triton_code if isinstance(exc, NnunetTritonError) else _FALLBACK_CODE
    code = getattr(pb.TritonError, code_name, None)
    if code is None:
        code = getattr(pb.TritonError, _FALLBACK_CODE)
    message = str(exc) if isinstance(exc, NnunetTritonError) else f"{type(exc).__name__}: {exc}"
    return pb.TritonError(message, code)


def ok_response(outputs: Mapping[str, Any]) -> Any:
    """Return a successful response with one output tensor per ``{name: array}`` entry."""
    tensors = [output_tensor(name, array) for name, array in outputs.items()]
    return pb_utils().InferenceResponse(output_tensors=tensors)


def error_response(exc: BaseException) -> Any:
    """Return a failed response for an expected error (bad input, unsupported model, failed submodel)."""
    return pb_utils().InferenceResponse(output_tensors=[], error=triton_error(exc))


def internal_error_response(exc: BaseException, logger: Any) -> Any:
    """Log ``exc`` with its traceback and return an INTERNAL error response.

    ``logger`` is ``pb_utils.Logger`` (``log_error``) or a ``logging.Logger``.
    """
    text = "".join(traceback.format_exception(exc))
    if hasattr(logger, "log_error"):
        logger.log_error(f"unexpected error: {text}")
    else:
        logger.error("unexpected error: %s", text)
    return error_response(exc)


def initialize_exception(model_name: str) -> Exception:
    """Return ``pb_utils.TritonModelException`` for a failed ``initialize`` (call inside ``except``).

    Usage: ``except Exception: raise serving.initialize_exception(args["model_name"]) from None``.
    """
    message = f"{model_name} initialize failed: {traceback.format_exc()}"
    logging.getLogger(__name__).error("%s", message)
    return pb_utils().TritonModelException(message)
