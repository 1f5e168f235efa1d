"""Where each expert's bytes live: the packed on-disk format and the manifest that describes it.

A flashmoe model folder keeps one file per MoE layer, `experts/layer_NNN.bin`. Expert e of that
layer starts at e * stride; its parts (gate/up/down weight, scales, biases) lie back to back, so
one read fetches one expert. The stride is a multiple of ALIGNMENT so O_DIRECT reads work.

Both the packed format and direct mode (reading out of an unconverted checkpoint) describe an
expert the same way, as a list of `Part`s and where each part's bytes are (`Extent`s); the
store does not care which it is streaming from.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from zlib_ng.zlib_ng import crc32  # zlib's CRC-32, many times faster

from flashmoe.engine.errors import ModelLoadError
from flashmoe.engine.runtime.jsonfile import read_json
from flashmoe.engine.formats.safetensors_io import DTYPES, ITEM_SIZES, array_bytes

FORMAT = "flashmoe-experts"
VERSION = 1  # every layer in MLX's layout
TILED_VERSION = 2  # some layers in tiles (LayerExperts.layout): an older flashmoe must refuse them
LAYOUTS = ("mlx", "tiles")
ALIGNMENT = 16 * 1024
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Part:
    """One tensor of one expert, e.g. `gate_proj.scales` of shape [I, H/64]."""

    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = ITEM_SIZES[self.dtype]
        for s in self.shape:
            n *= s
        return n

    @property
    def mx_dtype(self):
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Extent:
    """Bytes of consecutive parts of one expert: `nbytes` at `offset` of `path` fill parts[first:last]."""

    path: str
    offset: int
    nbytes: int
    first: int
    last: int


@dataclass
class LayerExperts:
    """The routed experts of one MoE layer."""

    layer: int
    module: str  # path of the switch module in the model, e.g. model.layers.3.mlp.switch_mlp
    num_experts: int
    parts: tuple[Part, ...]
    # packed format only
    file: str | None = None
    stride: int = 0
    checksums: list[int] = field(default_factory=list)
    quantization: dict | None = None  # {"bits", "group_size"} of these experts; None if float
    # direct mode only: sources[part][expert] = (path, offset) of that slice
    sources: list[list[tuple[str, int]]] | None = None
    # How each part's bytes are ordered: "mlx" (rows, as MLX stores them), or "tiles": rows in
    # groups of 16, each group stored column by column ([N/16, X, 16] for a part of [N, X]),
    # the CPU kernels' own order (engine/cpu/tiled.py), so a read lands ready to compute. The
    # part shapes and sizes are the same either way.
    layout: str = "mlx"

    @property
    def expert_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def extents(self, root: Path, expert: int) -> list[Extent]:
        if self.file is not None:
            return [Extent(str(root / self.file), expert * self.stride, self.expert_bytes, 0, len(self.parts))]
        return [Extent(*self.sources[i][expert], p.nbytes, i, i + 1) for i, p in enumerate(self.parts)]

    @property
    def signature(self) -> tuple:
        """Layers with the same signature can share one slot pool."""
        return (self.layout, *((p.name, p.dtype, p.shape) for p in self.parts))


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:03d}.bin"


def stride_for(expert_bytes: int) -> int:
    return -(-expert_bytes // ALIGNMENT) * ALIGNMENT


def write_layer(
    folder: Path,
    layer: int,
    module: str,
    tensors: dict[str, mx.array],
    part_names: list[str],
    quantization: dict | None = None,
    layout: str = "mlx",
) -> LayerExperts:
    """Pack one layer's stacked expert tensors ([E, ...] each) into experts/layer_NNN.bin, each
    part in `layout` (LayerExperts.layout: "tiles" reorders every part's rows in tiles of 16).

    Written under a temporary name and renamed, so a half-written file is never taken for a
    finished one.
    """
    from flashmoe.engine.formats.safetensors_io import DTYPE_NAMES

    first = tensors[part_names[0]]
    num_experts = first.shape[0]
    parts = tuple(Part(n, DTYPE_NAMES[tensors[n].dtype], tuple(tensors[n].shape[1:])) for n in part_names)
    expert_bytes = sum(p.nbytes for p in parts)
    stride = stride_for(expert_bytes)
    pad = b"\0" * (stride - expert_bytes)
    views = [array_bytes(tensors[n]) for n in part_names]
    if layout == "tiles":  # the same bytes in tile order (as unsigned ints of the element's size)
        views = [
            memoryview(to_tiles(np.frombuffer(v, f"u{p.nbytes // _elements(p)}").reshape(num_experts, *p.shape))).cast(
                "B"
            )
            for v, p in zip(views, parts)
        ]
    checksums = []
    name = layer_file_name(layer)
    tmp = folder / (name + ".partial")
    with open(tmp, "wb") as f:
        for e in range(num_experts):
            crc = 0
            for p, v in zip(parts, views):
                chunk = v[e * p.nbytes : (e + 1) * p.nbytes]
                f.write(chunk)
                crc = crc32(chunk, crc)
            f.write(pad)
            checksums.append(crc)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / name)
    return LayerExperts(
        layer,
        module,
        num_experts,
        parts,
        file=name,
        stride=stride,
        checksums=checksums,
        quantization=quantization,
        layout=layout,
    )


def _elements(p: Part) -> int:
    n = 1
    for s in p.shape:
        n *= s
    return n


def to_tiles(a: np.ndarray) -> np.ndarray:
    """Experts' parts [E, N, X] in tiles: [E, N/16, X, 16], element [e, t, x, l] = a[e, 16t + l, x]."""
    E, N, X = a.shape
    return np.ascontiguousarray(a.reshape(E, N // 16, 16, X).transpose(0, 1, 3, 2))


def from_tiles(tiles: np.ndarray, out: np.ndarray) -> None:
    """The inverse of to_tiles for one expert's part: tiles [N/16, X, 16] -> out [N, X]."""
    T, X, _ = tiles.shape
    out.reshape(T, 16, X)[:] = tiles.transpose(0, 2, 1)


def write_manifest(folder: Path, layers: list[LayerExperts], extra: dict | None = None) -> None:
    doc = {
        "format": FORMAT,
        "version": TILED_VERSION if any(l.layout != "mlx" for l in layers) else VERSION,
        "alignment": ALIGNMENT,
        **(extra or {}),
        "layers": [
            {
                "layer": l.layer,
                "module": l.module,
                "file": l.file,
                "num_experts": l.num_experts,
                "stride": l.stride,
                "expert_bytes": l.expert_bytes,
                "quantization": l.quantization,
                "parts": [{"name": p.name, "dtype": p.dtype, "shape": list(p.shape)} for p in l.parts],
                "checksums": l.checksums,
                **({"layout": l.layout} if l.layout != "mlx" else {}),
            }
            for l in layers
        ],
    }
    tmp = folder / (MANIFEST + ".partial")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> list[LayerExperts]:
    """Parse experts/manifest.json and check that every layer file has the size it promises."""
    path = folder / MANIFEST
    doc = read_json(path)
    if doc.get("format") != FORMAT:
        raise ModelLoadError(path, f"not a flashmoe expert manifest (format {doc.get('format')!r})")
    if doc.get("version") not in (VERSION, TILED_VERSION):
        raise ModelLoadError(
            path,
            f"format version {doc.get('version')} is not supported (this flashmoe reads {VERSION} and {TILED_VERSION})",
        )
    if not isinstance(doc.get("layers"), list):
        raise ModelLoadError(path, "malformed manifest (layers must be a list)")
    layers = []
    for i, d in enumerate(doc["layers"]):
        try:
            l = _layer_entry(d)
        except (KeyError, TypeError, ValueError) as e:
            name = d.get("layer") if isinstance(d, dict) and isinstance(d.get("layer"), int) else i
            raise ModelLoadError(path, f"layer {name}: malformed manifest entry ({e})") from None
        if l.expert_bytes != d["expert_bytes"] or l.stride < l.expert_bytes or len(l.checksums) != l.num_experts:
            raise ModelLoadError(path, f"layer {l.layer}: sizes in the manifest disagree with its part shapes")
        layers.append(l)
    for l in layers:
        f = folder / l.file
        try:
            size = f.stat().st_size
        except FileNotFoundError:
            raise ModelLoadError(f, "missing expert file") from None
        except OSError as e:
            raise ModelLoadError(f, f"cannot read: {e.strerror or e}") from None
        want = l.stride * l.num_experts
        if size != want:
            raise ModelLoadError(f, f"truncated or wrong size: {size} bytes, the manifest says {want}")
        if not os.access(f, os.R_OK):
            raise ModelLoadError(f, "not readable (permission denied)")
    return layers


def _count(v, low: int = 0) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{v!r} is not a whole number >= {low}")
    return v


def _layer_entry(d) -> LayerExperts:
    """One manifest layer, every field of the type it must have."""
    if not isinstance(d, dict):
        raise TypeError("not an object")
    parts = []
    for p in d["parts"]:
        if not isinstance(p["name"], str) or p["dtype"] not in ITEM_SIZES or not isinstance(p["shape"], list):
            raise ValueError(f"bad part {p!r}")
        parts.append(Part(p["name"], p["dtype"], tuple(_count(s) for s in p["shape"])))
    file = d["file"]
    if not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", ".."):
        raise ValueError(f"file {file!r} must be a file name inside experts/")
    if not isinstance(d["module"], str) or not isinstance(d["checksums"], list):
        raise TypeError("module must be a string and checksums a list")
    checksums = [_count(c) for c in d["checksums"]]
    _count(d["expert_bytes"])
    layout = d.get("layout", "mlx")
    if layout not in LAYOUTS or (layout == "tiles" and any(len(p.shape) != 2 or p.shape[0] % 16 for p in parts)):
        raise ValueError(f"layout {layout!r} (one of {', '.join(LAYOUTS)}; tiles need parts of [16n, x])")
    return LayerExperts(
        _count(d["layer"]),
        d["module"],
        _count(d["num_experts"], 1),
        tuple(parts),
        file=file,
        stride=_count(d["stride"], 1),
        checksums=checksums,
        quantization=d.get("quantization"),
        layout=layout,
    )


def verify(folder: Path, layers: list[LayerExperts], progress=None) -> list[tuple[int, int, str]]:
    """Check every expert block against its checksum; return (layer, expert, file) of each failure."""
    bad = []
    for l in layers:
        path = folder / l.file
        with open(path, "rb") as f:
            for e in range(l.num_experts):
                f.seek(e * l.stride)
                data = f.read(l.expert_bytes)
                if len(data) != l.expert_bytes or crc32(data) != l.checksums[e]:
                    bad.append((l.layer, e, str(path)))
        if progress:
            progress(l)
    return bad
