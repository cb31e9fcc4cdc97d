"""numpy arrays on the wire: a map ``{"dtype": name, "shape": [...], "data": raw little-endian bytes}``.

Decoding is ``np.frombuffer`` plus a reshape: no per-element Python work. Decoded arrays are views of
the received frame (read-only, unless the receiver alone owns its frames: ``FrameDecoder(writable_bodies=True)``);
copy a read-only one before writing to it.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from broker.protocol.errors import ErrorCode, RemoteProtocolError, summarize

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


# Native numpy dtypes that are already their wire form, keyed by dtype: one dict lookup per array.
WIRE_NAMES: Final[dict[np.dtype[Any], str]] = {dtype: name for name, dtype in DTYPES.items()}


def dtype_name(dtype: np.dtype[Any]) -> str:
    name = WIRE_NAMES.get(dtype)
    if name is not None:
        return name
    name = np.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype {name} cannot cross the wire; use one of {sorted(DTYPES)}")
    return name


def encode_array(array: np.ndarray) -> dict[str, Any]:
    """The array map; ``data`` is a view of the array's memory when it is already contiguous wire data."""
    name = WIRE_NAMES.get(array.dtype)
    if name is None or array.ndim == 0 or not array.flags.c_contiguous:
        name = dtype_name(array.dtype)
        array = np.ascontiguousarray(array, dtype=DTYPES[name])  # also makes a 0-d array 1-d, as it always did
    data = array.data.cast("B") if array.size else b""  # memoryview cannot cast a view with a zero dimension
    return {"dtype": name, "shape": list(array.shape), "data": data}


def decode_array(obj: Any, what: str) -> np.ndarray:
    """Validate and view an encoded array. ``what`` names it in error messages.

    The result is a view of ``data``: no copy, no per-element work. It is read-only unless ``data`` is a
    writable view of a frame its receiver alone owns (``FrameDecoder(writable_bodies=True)``).
    """
    if not isinstance(obj, dict):
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: expected an array map, got {type(obj).__name__}")
    name, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    dtype = DTYPES.get(name) if type(name) is str else None
    if dtype is None:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: unknown dtype {summarize(name)}")
    if type(shape) is not list or len(shape) > MAX_NDIM:
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: bad shape {summarize(shape)}")
    count = 1
    for d in shape:
        if type(d) is not int or d < 0:  # type() is int: no bools, no floats
            raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: bad shape {summarize(shape)}")
        count *= d
    if not isinstance(data, (bytes, memoryview)):  # memoryview: a view of the frame (codec.unpack_viewing_arrays)
        raise RemoteProtocolError(ErrorCode.MALFORMED, f"{what}: data must be binary")
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise RemoteProtocolError(
            ErrorCode.MALFORMED, f"{what}: shape {shape} of {name} needs {expected} bytes, got {len(data)}"
        )
    return np.ndarray(shape, dtype, data)  # a view of data, as frombuffer + reshape, in one call
