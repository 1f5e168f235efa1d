"""Safetensors headers and a streaming writer.

We read headers ourselves (not the whole file) to know where each tensor's bytes lie, which is
what direct mode streams from; and we write tensor by tensor so a conversion never holds the
whole model in memory.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import mlx.core as mx

from flashmoe.engine.errors import ModelLoadError

# safetensors dtype names <-> MLX dtypes
DTYPES = {
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U8": mx.uint8,
    "I8": mx.int8,
    "BOOL": mx.bool_,
    "I64": mx.int64,
    "U64": mx.uint64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEM_SIZES = {
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "U16": 2,
    "I16": 2,
    "U8": 1,
    "I8": 1,
    "BOOL": 1,
    "I64": 8,
    "U64": 8,
}
MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "U32"
    shape: tuple[int, ...]
    path: Path
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """Every tensor in one safetensors file, with absolute data offsets."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(path, "not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER or n + 8 > size:
                raise ModelLoadError(path, "not a safetensors file (bad header length)")
            header = json.loads(f.read(n))
    except OSError as e:
        raise ModelLoadError(path, f"cannot read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(path, "not a safetensors file (header is not JSON)") from None
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if base + end > size:
            raise ModelLoadError(path, f"truncated: tensor {name} ends past the end of the file")
        out[name] = TensorInfo(name, meta["dtype"], tuple(meta["shape"]), path, base + begin, end - begin)
    return out


def read_headers(paths: Iterable[Path]) -> dict[str, TensorInfo]:
    out: dict[str, TensorInfo] = {}
    for p in paths:
        out.update(read_header(p))
    return out


def array_bytes(a: mx.array) -> memoryview:
    """The raw bytes of an evaluated array (C order), without a copy where possible."""
    mx.eval(a)
    view = memoryview(a)
    if not view.c_contiguous:  # a slice of a bigger tensor (e.g. half of a fused gate_up)
        a = mx.contiguous(a)
        mx.eval(a)
        view = memoryview(a)
    return view.cast("B")


def write_streaming(path: str | Path, items: list[tuple[str, mx.array]], metadata: dict | None = None) -> None:
    """Write safetensors from (name, lazy array) pairs, evaluating one tensor at a time.

    The header needs every shape first; shapes of lazy arrays are known without evaluation,
    so we list them, write the header, then evaluate and write each tensor and drop it.
    `items` is consumed (emptied) so that nothing keeps a written tensor alive.
    """
    items.reverse()
    header: dict = {}
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    offset = 0
    for name, a in reversed(items):
        nbytes = a.nbytes
        header[name] = {
            "dtype": DTYPE_NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep data 8-byte aligned, as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        while items:
            _, a = items.pop()
            f.write(array_bytes(a))
            del a
        f.flush()
        os.fsync(f.fileno())
