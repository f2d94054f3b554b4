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
    "ConfigParameterError",
    "InputValidationError",
    "SubmodelError",
    "ExportError",
    "ThreadBudgetError",
    "ServerError",
    "PreloadUnavailableError",
    "NumericalError",
    "ClientError",
    "DeployError",
    "PacsError",
    "ServerUnavailableError",
    "ServerNotRunningError",
    "RepositoryError",
    "OlderRepositoryError",
    "NotBuiltRepositoryError",
    "RequestCancelledError",
    "ResourceExhaustedError",
    "NOT_RUNNING_MESSAGES",
]

# Triton's words for a model that is not running: its stub process died ("Stub process 'fold_0_0_0' is
# not healthy."), it is unloaded or being reloaded ("Model 'fold_0' is not ready", "... has no available
# versions"). Triton calls these INTERNAL or NOT_FOUND; they are transient (nnunet_triton.server.watchdog
# reloads the model), so the orchestrator re-codes them UNAVAILABLE and the client retries them.
NOT_RUNNING_MESSAGES = ("is not healthy", "is not ready", "has no available versions")


class NnunetTritonError(Exception):
    """Base class of all errors raised on purpose by nnunet_triton."""

    triton_code: str = "INTERNAL"


class PlansError(NnunetTritonError):
    """A model folder, plans.json, dataset.json or checkpoint is missing or malformed."""

    triton_code = "INVALID_ARG"


class UnsupportedModelError(PlansError):
    """The model uses an nnU-Net setting this project does not (yet) reproduce."""

    triton_code = "UNSUPPORTED"


class ConfigParameterError(PlansError, ValueError):
    """A parameter of a model's config.pbtxt is malformed or breaks its rule (``parameters.py``)."""


class InputValidationError(NnunetTritonError):
    """A request's input tensor or parameter breaks a documented rule."""

    triton_code = "INVALID_ARG"


class SubmodelError(NnunetTritonError):
    """A composing model called through BLS returned an error.

    ``triton_code`` is the callee's own code (``serving.bls`` reads ``error.code()``), so UNAVAILABLE
    stays UNAVAILABLE for the client's retry; INTERNAL when the callee gave none.
    """

    triton_code = "INTERNAL"

    def __init__(self, message: str, *, triton_code: str | None = None) -> None:
        super().__init__(message)
        if triton_code is not None:
            self.triton_code = triton_code


class ExportError(NnunetTritonError):
    """A network could not be exported, or the exported file disagrees with the eager network."""

    triton_code = "INTERNAL"


class ThreadBudgetError(NnunetTritonError, ValueError):
    """A thread setting that cannot be honoured (malformed, or more threads than available CPUs)."""

    triton_code = "INVALID_ARG"


class ServerError(NnunetTritonError):
    """The embedded tritonserver failed to start, died, or did not become ready."""

    triton_code = "UNAVAILABLE"


class PreloadUnavailableError(ServerError):
    """The LD_PRELOAD library (``server.preload``) that keeps the control token off tritonserver's command
    line and its /dev/shm regions private is missing and cannot be built (no C compiler, a failed compile)."""


class NumericalError(NnunetTritonError):
    """A numerical result is unusable, e.g. ``inf`` in the stitched fp16 logits (nnU-Net raises too)."""

    triton_code = "INTERNAL"


class ClientError(NnunetTritonError):
    """A client call failed: server unreachable or not ready, or the server answered with an error.

    ``status`` is the server's status (HTTP code or gRPC status name) when it answered, else None;
    the message carries the server's own message.
    """

    triton_code = "UNAVAILABLE"

    def __init__(self, message: str, *, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


class ServerUnavailableError(ClientError):
    """The server answered UNAVAILABLE (or a composing model was not running): the same request may
    succeed later (``nnunet_triton.util.retry`` decides this from the status code)."""


class ServerNotRunningError(ClientError, ServerError):
    """The server was not reached (connection refused, no such host, no answer in time): nothing runs
    there, so there is no status; the command line exits 3 for it (``nnunet_triton.exit_codes``). A
    :class:`ServerError` too, for the launcher's model-control calls."""


class PacsError(ClientError):
    """A PACS could not be reached, refused a request (DICOMweb status, DIMSE association or status), or
    has no such study or series; the message names the study or series UID, never patient data."""


class DeployError(NnunetTritonError):
    """A deployment cannot work as asked: e.g. TorchScript files exported with a torch newer than the
    serving image's libtorch, a repository whose models disagree with its metadata, no GPU for a gpu target.
    """

    triton_code = "UNSUPPORTED"


class RepositoryError(NnunetTritonError):
    """A model repository cannot do what was asked: an unknown endpoint name or version, a registry that is
    malformed or from an older nnunet-triton, removing the promoted version, a repository locked too long."""

    triton_code = "NOT_FOUND"


class OlderRepositoryError(RepositoryError):
    """The repository was written by an older nnunet-triton (one model, no registry of endpoints)."""


class NotBuiltRepositoryError(RepositoryError):
    """The folder has no registry: it is not a model repository built by nnunet-triton (its one message is
    written by ``nnunet_triton.repository.registry.require_registry``)."""


class RequestCancelledError(NnunetTritonError):
    """The client cancelled the request (``request.is_cancelled()``); the work left was not started."""

    triton_code = "CANCELLED"


class ResourceExhaustedError(NnunetTritonError):
    """A request does not fit the memory its model instance has now (free device or available host memory).

    UNAVAILABLE: Triton's Python backend has no RESOURCE_EXHAUSTED code, and memory held by other requests
    comes back, so a retry later (or on another replica) may succeed; the message names the numbers.
    """

    triton_code = "UNAVAILABLE"
