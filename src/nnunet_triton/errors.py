"""One exception hierarchy for the whole project.

Every class carries ``triton_code``, the name of the ``pb_utils.TritonError`` code it maps to.
The library never imports Triton; ``nnunet_triton.serving`` is the only place that turns these
into Triton errors.
"""

from __future__ import annotations

__all__ = [
    "NnunetTritonError",
    "PlansError",
    "UnsupportedModelError",
    "InputValidationError",
    "SubmodelError",
    "ResourceExhaustedError",
    "ExportError",
    "ServerError",
]


class NnunetTritonError(Exception):
    """Base class of all errors raised on purpose by nnunet_triton."""

    triton_code: str = "INTERNAL"


class PlansError(NnunetTritonError):
    """A model folder, plans.json, dataset.json or checkpoint is missing or malformed."""

    triton_code = "INVALID_ARG"


class UnsupportedModelError(PlansError):
    """The model uses an nnU-Net setting this project does not (yet) reproduce."""

    triton_code = "UNSUPPORTED"


class InputValidationError(NnunetTritonError):
    """A request's input tensor or parameter breaks a documented rule."""

    triton_code = "INVALID_ARG"


class SubmodelError(NnunetTritonError):
    """A composing model called through BLS returned an error."""

    triton_code = "INTERNAL"


class ResourceExhaustedError(NnunetTritonError):
    """A request needs more memory or capacity than the deployment allows."""

    triton_code = "UNAVAILABLE"


class ExportError(NnunetTritonError):
    """A network could not be exported, or the exported file disagrees with the eager network."""

    triton_code = "INTERNAL"


class ServerError(NnunetTritonError):
    """The embedded tritonserver failed to start, died, or did not become ready."""

    triton_code = "UNAVAILABLE"
