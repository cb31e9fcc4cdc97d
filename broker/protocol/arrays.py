"""numpy arrays on the wire: a map ``{"dtype": name, "shape": [...], "data": raw little-endian bytes}``.

Decoding is ``np.frombuffer`` plus a reshape: no per-element Python work. Decoded arrays are read-only
views of the received body; copy before writing to them.
"""

from __future__ import annotations

import math
from typing import Any, Final

import numpy as np

from broker.protocol.errors import ErrorCode, RemoteProtocolError

# Wire dtype names and their little-endian numpy dtypes. Nothing else crosses the wire.
DTYPES: Final[dict[str, np.dtype[Any]]] = {
    "bool": np.dtype("?"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "int16": np.dtype("<i2"),
    "uint16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "uint32": np.dtype("<u4"),
    "int64": np.dtype("<i8"),
    "uint64": np.dtype("<u8"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
}
MAX_NDIM: Final = 8


def dtype_name(dtype: np.dtype[Any]) -> str:
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot cross the wire; use one of {sorted(DTYPES)}")
    return name


def encode_array(array: np.ndarray) -> dict[str, Any]:
    name = dtype_name(array.dtype)
    wire = np.ascontiguousarray(array, dtype=DTYPES[name])
    return {"dtype": name, "shape": list(wire.shape), "data": wire.data.cast("B")}


def decode_array(obj: Any, what: str) -> np.ndarray:
    """Validate and view an encoded array. ``what`` names it in error messages."""
    if not isinstance(obj, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: expected an array map, got {type(obj).__name__}")
    name, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if not isinstance(name, str) or name not in DTYPES:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: unknown dtype {name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: bad shape {shape!r}")
    if not isinstance(data, bytes):
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: data must be binary")
    dtype = DTYPES[name]
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise RemoteProtocolError(
            ErrorCode.MALFORMED, f"{what}: shape {shape} of {name} needs {expected} bytes, got {len(data)}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)
