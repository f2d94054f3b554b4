"""Minimal client for an nnU-Net endpoint (``nnunet``, or any name the repository serves, at its promoted
version or a pinned one): one call per case, binary tensors, typed errors.

``tritonclient`` is imported lazily (in :class:`NnunetClient`'s constructor), so importing this module
stays cheap. Per-request options travel as Triton request parameters, which the ``nnunet`` ensemble
forwards to every composing model (see ``docs/architecture.md``).

Example::

    with NnunetClient("127.0.0.1:8000", endpoint="liver") as client:   # "nnunet" by default
        result = client.segment(image, spacing, mirroring=False)
        result.segmentation  # uint8/uint16 array shaped like image.shape[1:]
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

import numpy as np

from nnunet_triton import io_names
from nnunet_triton.client.deprecation import renamed_keyword
from nnunet_triton.client.tls import ClientTls, triton_client
from nnunet_triton.dtypes import numpy_dtype
from nnunet_triton.errors import (
    ClientError,
    InputValidationError,
    ServerNotRunningError,
    ServerUnavailableError,
)
from nnunet_triton.options import DEFAULT_CLIENT_TIMEOUT_S, RequestOptions
from nnunet_triton.util.retry import is_retryable, triton_code

__all__ = ["SegmentationResult", "NnunetClient", "PROTOCOLS", "endpoint_model"]

LOGGER = logging.getLogger(__name__)
PROTOCOLS = ("http", "grpc")


@dataclass(frozen=True)
class SegmentationResult:
    """What one ``segment`` call returns.

    Attributes:
        segmentation: label map ``(*spatial)`` (uint8, or uint16 for > 254 foreground labels), same axis
            order and shape as the input image's spatial axes.
        probabilities: float32 ``(K, *spatial)`` when requested, else None.
        elapsed_s: wall time of the inference call (request sent to response decoded).
    """

    segmentation: np.ndarray
    probabilities: np.ndarray | None
    elapsed_s: float


# numpy dtypes that travel as they are, each to its typed endpoint (io_names.IMAGE_DTYPES)
WIRE_DTYPES = {numpy_dtype(wire): wire for wire in io_names.IMAGE_DTYPES}


def _as_image(image: Any, n_spatial: int, *, native: bool = True) -> np.ndarray:
    """C-contiguous ``(C, *spatial)``: in its own dtype when that is a wire dtype (``native``), else
    float32 (what the FP32 endpoint takes; nnU-Net casts every image to float32 first)."""
    array = np.asarray(image)
    if array.dtype.kind not in "biuf":
        raise InputValidationError(f"image must have a real numeric dtype, got {array.dtype}.")
    if array.ndim == n_spatial:  # single-channel convenience: add the channel axis
        array = array[None]
    native_order = array.dtype.newbyteorder("=")
    return np.ascontiguousarray(array, dtype=native_order if native and native_order in WIRE_DTYPES
                                else np.float32)


def _as_spacing(spacing: Sequence[float]) -> np.ndarray:
    try:
        return np.ascontiguousarray(np.asarray(spacing, dtype=np.float64).reshape(-1))
    except (TypeError, ValueError):
        raise InputValidationError(f"spacing must be a sequence of numbers, got {spacing!r}.") from None


def endpoint_model(model: str = io_names.ENDPOINT_MODEL, version: int | None = None) -> str:
    """The Triton model to call for endpoint ``model``: the public endpoint (its promoted version), or the
    pinned endpoint ``<model>__v<version>`` of exactly ``version``.

    Raises:
        ValueError: ``version`` is not an integer >= 1.
    """
    return model if version is None else io_names.pinned_endpoint(model, io_names.check_version(version))


def _endpoint_argument(endpoint: str | None, model: str | None, model_name: str | None) -> str:
    """``endpoint`` (default ``nnunet``) with the deprecated spellings ``model`` / ``model_name`` warned."""
    endpoint = renamed_keyword("NnunetClient", "model", model, "endpoint", endpoint, stacklevel=3)
    if model_name is not None:
        warnings.warn("NnunetClient(model_name=...) is deprecated and will be removed in the next release: "
                      "use endpoint=... (a full Triton model name works, without version)",
                      DeprecationWarning, stacklevel=3)
    return io_names.ENDPOINT_MODEL if endpoint is None else endpoint


class NnunetClient:
    """Talks to one endpoint of a Triton server serving nnU-Net models (``nnunet`` by default).

    Args:
        url: ``host:port`` of the HTTP (default 8000) or gRPC (default 8001) endpoint.
        protocol: ``"http"`` or ``"grpc"``.
        timeout_s: end-to-end limit of one inference (HTTP network timeout, gRPC client deadline).
        endpoint: the endpoint name (``nnunet``, ``liver``, ...: ``nnunet-triton build --endpoint``), or any
            Triton model of the server by its full name (``liver__v2``, ``liver__v2__fold_0``).
        version: call exactly this version of ``endpoint`` (its pinned endpoint ``<endpoint>__v<version>``);
            default: the version the server promoted for ``endpoint``.
        native_dtype: send FP16/INT16/UINT16/UINT8 images as they are, to the typed endpoint
            (``nnunet_int16``, ...: half the bytes of float32 for a CT), when the server has it; False,
            or a repository without typed endpoints, sends float32 to the FP32 endpoint. Same answer.
        model: deprecated spelling of ``endpoint`` (kept for one release, with a DeprecationWarning).
        model_name: deprecated: the Triton model to call verbatim, now ``endpoint=`` without ``version``
            (kept for one release, with a DeprecationWarning; wins over ``endpoint`` and ``version``).
        tls: CA and client certificate of a TLS server (``client.tls``); default: from
            ``$NNUNET_TRITON_CA``/``_CERT``/``_KEY`` when set, else plain HTTP/gRPC.

    Raises:
        ValueError: an unknown protocol, a timeout <= 0, or ``endpoint`` and its deprecated spelling
            ``model`` both given.
    """

    def __init__(
        self,
        url: str,
        protocol: str = "http",
        timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S,
        *,
        endpoint: str | None = None,
        version: int | None = None,
        native_dtype: bool = True,
        model: str | None = None,
        model_name: str | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}.")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}.")
        self.url = url
        self.protocol = protocol
        self.timeout_s = float(timeout_s)
        endpoint = _endpoint_argument(endpoint, model, model_name)
        self.model_name = model_name or endpoint_model(endpoint, version)
        self.native_dtype = native_dtype
        self._typed_ready: dict[str, bool] = {}
        self._client = triton_client(url, protocol, self.timeout_s, tls)
        if protocol == "http":
            import tritonclient.http as module
        else:
            import tritonclient.grpc as module
        self._module = module
        self._ready = False

    def __enter__(self) -> NnunetClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self._client.close()

    def check_ready(self) -> None:
        """Raise :class:`ClientError` with a clear message unless the server and the endpoint are ready."""
        where = f"{self.protocol}://{self.url}"
        try:
            live = self._client.is_server_live()
        except Exception as exc:  # connection refused, DNS, timeouts: all mean "not reachable"
            raise ServerNotRunningError(
                f"Triton server at {where} is not reachable ({type(exc).__name__}: {exc}); is it running "
                "and is this the right host:port for the protocol?"
            ) from None
        if not live:
            raise ClientError(f"Triton server at {where} is not live.")
        try:
            ready = self._client.is_model_ready(self.model_name)
        except Exception as exc:
            raise ClientError(
                f"could not ask {where} whether model {self.model_name!r} is ready: {exc}"
            ) from None
        if not ready:
            raise ServerUnavailableError(
                f"model {self.model_name!r} is not ready on {where} (not in the repository, still loading, "
                "or failed to load: see the server log)."
            )
        self._ready = True

    def segment(
        self,
        image: Any,
        spacing: Sequence[float],
        options: RequestOptions | None = None,
        **overrides: Any,
    ) -> SegmentationResult:
        """Segment one case with a single endpoint call.

        Args:
            image: ``(C, *spatial)`` (or ``(*spatial)`` for one channel) in the reader's axis order
                (SimpleITK: z, y, x); any real dtype: float32/float16/int16/uint16/uint8 travel as they
                are (``native_dtype``), others as float32. The answer is the same either way.
            spacing: voxel spacing per spatial axis in the same order.
            options: the request options (``nnunet_triton.options.RequestOptions``; default: nnU-Net's).
            **overrides: options fields to change, e.g. ``mirroring=False``, ``folds=[0, 1]``,
                ``probabilities=True``, ``tile_step_size=0.75``, ``postprocessing=False``.

        Raises:
            InputValidationError: the image is not real-valued, or an option breaks its rule.
            ClientError: the server is not reachable/ready, or it answered with an error (message and
                ``status`` are the server's).
        """
        options = replace(options or RequestOptions(), **overrides)
        probabilities = options.probabilities
        spacing_array = _as_spacing(spacing)
        image_array = _as_image(image, spacing_array.size, native=self.native_dtype)
        if not self._ready:
            self.check_ready()
        model, wire = self._endpoint_for(image_array.dtype)
        if wire == "FP32" and image_array.dtype != np.float32:
            image_array = image_array.astype(np.float32)
        inputs = [
            self._input(io_names.IMAGE, image_array, wire),
            self._input(io_names.SPACING, spacing_array, "FP64"),
        ]
        names = [io_names.SEGMENTATION] + ([io_names.PROBABILITIES] if probabilities else [])
        outputs = [self._output(name) for name in names]
        start = time.perf_counter()
        response = self._infer(inputs, outputs, options.to_parameters(), model)
        segmentation = response.as_numpy(io_names.SEGMENTATION)
        probs = response.as_numpy(io_names.PROBABILITIES) if probabilities else None
        elapsed = time.perf_counter() - start
        if segmentation is None or (probabilities and probs is None):
            raise ClientError(f"model {self.model_name!r} answered without {names}.")
        LOGGER.debug("segmented %s in %.3f s", image_array.shape, elapsed)
        return SegmentationResult(segmentation=segmentation, probabilities=probs, elapsed_s=elapsed)

    def _endpoint_for(self, dtype: np.dtype) -> tuple[str, str]:
        """(model, wire dtype) for an image of ``dtype``: its typed endpoint when the server has it."""
        wire = WIRE_DTYPES.get(np.dtype(dtype), "FP32")
        if wire == "FP32":
            return self.model_name, wire
        model = io_names.typed_endpoint(wire, self.model_name)
        if model not in self._typed_ready:
            try:
                self._typed_ready[model] = bool(self._client.is_model_ready(model))
            except Exception:  # an older repository: the model is unknown
                self._typed_ready[model] = False
            if not self._typed_ready[model]:
                LOGGER.info("%s is not served on %s; sending %s images as FP32", model, self.url, wire)
        return (model, wire) if self._typed_ready[model] else (self.model_name, "FP32")

    def _input(self, name: str, array: np.ndarray, dtype: str) -> Any:
        tensor = self._module.InferInput(name, list(array.shape), dtype)
        if self.protocol == "http":
            tensor.set_data_from_numpy(array, binary_data=True)
        else:
            tensor.set_data_from_numpy(array)
        return tensor

    def _output(self, name: str) -> Any:
        if self.protocol == "http":
            return self._module.InferRequestedOutput(name, binary_data=True)
        return self._module.InferRequestedOutput(name)

    def _infer(self, inputs: list[Any], outputs: list[Any], params: dict[str, Any], model: str | None = None
               ) -> Any:
        from tritonclient.utils import InferenceServerException

        model = model or self.model_name
        kwargs: dict[str, Any] = {"outputs": outputs, "parameters": params}
        if self.protocol == "grpc":
            kwargs["client_timeout"] = self.timeout_s
        try:
            return self._client.infer(model, inputs, **kwargs)
        except InferenceServerException as exc:
            status = exc.status()
            unavailable = is_retryable(triton_code(status, exc.message() or ""))
            raise (ServerUnavailableError if unavailable else ClientError)(
                f"model {model!r} on {self.protocol}://{self.url} failed"
                f"{f' ({status})' if status else ''}: {exc.message()}",
                status=str(status) if status is not None else None,
            ) from None
        except Exception as exc:  # transport errors (connection reset, timeouts) of either client
            raise ClientError(
                f"model {model!r} on {self.protocol}://{self.url}: request failed "
                f"({type(exc).__name__}: {exc})."
            ) from None
