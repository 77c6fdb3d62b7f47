"""Minimal numpy reader/writer for the safetensors format, memory-mapped.

Why not ``safetensors.numpy``: plain numpy has no bfloat16, and checkpoints of the
models we train are bf16. The format is an 8-byte little-endian header length, a JSON
header ``{name: {dtype, shape, data_offsets}}`` and a flat byte buffer; reading it
ourselves lets every tensor be an ``np.memmap`` (only the slices a device needs are
read) with ml_dtypes' bfloat16, and lets a damaged file fail with the tensor's name.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(bool),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER_BYTES = 100 * 2**20


class CheckpointError(ValueError):
    """A checkpoint file or tensor that cannot be used; the message names which."""


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Tensor name → read-only memory-mapped array for one ``.safetensors`` file."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes), no safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path}: header length {header_len} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path}: corrupted safetensors header ({err})") from err
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        try:
            dtype = DTYPES.get(info["dtype"])
            shape = tuple(int(s) for s in info["shape"])
            start, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from err
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']!r}")
        expected = math.prod(shape) * dtype.itemsize
        if end - start != expected:
            raise CheckpointError(
                f"{path}: tensor {name!r} spans {end - start} bytes, shape {shape} {info['dtype']} needs {expected}")
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, file has {size}")
        if expected == 0:
            tensors[name] = np.zeros(shape, dtype)
        else:
            tensors[name] = np.memmap(path, dtype=dtype, mode="r", offset=data_start + start, shape=shape)
    return tensors


def read_checkpoint_dir(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of an HF directory: ``model.safetensors.index.json`` shards or every ``*.safetensors``."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from err
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).exists()]
        if missing:
            raise CheckpointError(f"{index} lists shard files that do not exist: {missing}")
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for name, array in read_safetensors(directory / file).items():
            if name in tensors:
                raise CheckpointError(f"{directory}: tensor {name!r} appears in more than one shard")
            tensors[name] = array
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CheckpointError(f"{index} maps tensors no shard contains: {absent[:5]}")
    return tensors


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (contiguous little-endian) as one safetensors file."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r}: dtype {array.dtype} cannot be written to safetensors")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())
