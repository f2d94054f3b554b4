"""The one table of data types: Triton's names (config.pbtxt ``TYPE_FP32``, the wire's ``FP32``) and NumPy's.

Used by the config generator, the Python models (declared output dtypes), the fold runner and the
clients; ``io_names.IMAGE_DTYPES`` names the subset an IMAGE may travel in.
"""

from __future__ import annotations

import numpy as np

__all__ = ["TRITON_TO_NUMPY", "triton_dtype", "wire_dtype", "numpy_dtype"]

# Triton name (without TYPE_) -> NumPy dtype name; BF16 has no NumPy dtype, STRING travels as objects
TRITON_TO_NUMPY: dict[str, str | None] = {
    "BOOL": "bool", "UINT8": "uint8", "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64",
    "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64", "BF16": None, "STRING": "object",
}
_NUMPY_TO_TRITON = {np.dtype(name): triton for triton, name in TRITON_TO_NUMPY.items()
                    if name is not None and triton != "STRING"}


def wire_dtype(dtype: object) -> str:
    """The wire name (``"FP32"``) of a Triton name (``"FP32"``, ``"TYPE_FP32"``, ``"BYTES"``) or NumPy dtype.

    Raises:
        ValueError: if ``dtype`` names no Triton data type.
    """
    if isinstance(dtype, str):
        name = dtype.upper().removeprefix("TYPE_")
        name = "STRING" if name == "BYTES" else name
        if name in TRITON_TO_NUMPY:
            return name
        raise ValueError(f"dtype must be one of {sorted(TRITON_TO_NUMPY)} (or BYTES / TYPE_*), "
                         f"got {dtype!r}.")
    try:
        np_dtype = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise ValueError(f"dtype must be a Triton type name or a numpy dtype, got {dtype!r}.") from exc
    if np_dtype.kind in ("O", "S"):
        return "STRING"
    name = _NUMPY_TO_TRITON.get(np_dtype.newbyteorder("="))
    if name is None:
        raise ValueError(f"numpy dtype {np_dtype} has no Triton equivalent.")
    return name


def triton_dtype(dtype: object) -> str:
    """The config.pbtxt name (``"TYPE_FP32"``) of a Triton name or NumPy dtype (see :func:`wire_dtype`)."""
    return f"TYPE_{wire_dtype(dtype)}"


def numpy_dtype(dtype: str) -> np.dtype:
    """The NumPy dtype of a Triton name (``"FP32"`` or ``"TYPE_FP32"``).

    Raises:
        ValueError: not a Triton name, or one without a NumPy dtype (BF16).
    """
    name = TRITON_TO_NUMPY[wire_dtype(dtype)]
    if name is None:
        raise ValueError(f"Triton dtype {dtype!r} has no NumPy equivalent.")
    return np.dtype(name)
