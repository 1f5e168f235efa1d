"""flashmoe convert: an mlx-lm folder in, a flashmoe model folder out.

Tensors flow one at a time: the source is opened lazily (mx.load maps nothing until a tensor is
evaluated), mlx-lm's own sanitize and quantize build lazy results, and we evaluate and write each
result and drop it. Peak memory is about one layer's experts plus one resident tensor.

The output is built in OUT.partial and renamed to OUT at the end, so OUT either is complete or
does not exist. Finished layers survive an interruption and are not redone.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from flashmoe.engine.errors import ConvertError, ModelLoadError
from flashmoe.engine.experts.layout import MANIFEST, LayerExperts, Part, layer_file_name, write_layer, write_manifest
from flashmoe.engine.experts.blocks import declared_experts, expert_tensor_of, no_blocks_reason, resident_expert_modules
from flashmoe.engine.runtime.loader import (
    EXPERTS_DIR,
    RESIDENT,
    _mx_load,
    _safetensors_files,
    build_model,
    check_expert_counts,
    direct_headers,
    layer_index,
    quantize_like_checkpoint,
    read_config,
    switch_modules,
    text_config,
)
from flashmoe.engine.runtime.jsonfile import read_json
from flashmoe.engine.formats.safetensors_io import write_streaming

# Files copied as they are: tokenizer, chat template, generation settings.
_COPY_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
# (the usage file is what runs of the source learned: the converted folder learns its own)
_NOT_COPIED = {"config.json", "model.safetensors.index.json", "expert-usage.json"}

Progress = Callable[[str, int, int], None]


def is_converted(path: Path) -> bool:
    return (path / "config.json").exists() and (path / RESIDENT).exists() and (path / EXPERTS_DIR / MANIFEST).exists()


@dataclass(frozen=True)
class QuantPlan:
    """What to quantize to how many bits. Experts may differ from the rest, and per layer."""

    bits: int | None = None  # resident weights (and experts, unless expert_bits is given)
    group_size: int = 64
    expert_bits: int | None = None
    layer_bits: tuple[tuple[int, int], ...] = ()  # (layer, bits) overrides for routed experts

    @property
    def active(self) -> bool:
        return self.bits is not None or self.expert_bits is not None or bool(self.layer_bits)

    def check(self, src: Path) -> None:
        for b in (self.bits, self.expert_bits, *(b for _, b in self.layer_bits)):
            if b is not None and b not in SUPPORTED_BITS:
                raise ConvertError(src, f"{b} bits is not supported (use 2, 3, 4, 5, 6 or 8)")
        if self.group_size not in (32, 64, 128):
            raise ConvertError(src, f"group size {self.group_size} is not supported (use 32, 64 or 128)")
        if self.layer_bits and self.expert_bits is None and self.bits is None:
            raise ConvertError(src, "per-layer expert bits need --expert-bits or --bits for the other layers")

    def expert_bits_for(self, layer: int) -> int | None:
        return dict(self.layer_bits).get(layer, self.expert_bits if self.expert_bits is not None else self.bits)


SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


def parse_layer_bits(specs: list[str], num_layers: int) -> tuple[tuple[int, int], ...]:
    """'first:2=4', 'last:2=4', '3-5=8', '7=8' -> ((layer, bits), ...). Later specs win."""
    out: dict[int, int] = {}
    for spec in specs:
        try:
            where, bits = spec.split("=")
            bits = int(bits)
            if where.startswith("first:"):
                layers = range(0, int(where[6:]))
            elif where.startswith("last:"):
                layers = range(num_layers - int(where[5:]), num_layers)
            elif "-" in where:
                lo, hi = where.split("-")
                layers = range(int(lo), int(hi) + 1)
            else:
                layers = [int(where)]
        except ValueError:
            raise ValueError(
                f"--layer-bits {spec!r}: expected LAYERS=BITS with LAYERS like 7, 3-5, first:2 or last:2"
            ) from None
        for l in layers:
            if not 0 <= l < num_layers:
                raise ValueError(f"--layer-bits {spec!r}: layer {l} does not exist (the model has {num_layers})")
            out[l] = bits
    return tuple(sorted(out.items()))


def convert(
    src: str | Path,
    out: str | Path,
    *,
    bits: int | None = None,
    group_size: int = 64,
    expert_bits: int | None = None,
    layer_bits=(),
    dtype: str | None = None,
    progress: Progress | None = None,
    expert_layout: str = "auto",
    _fail_after_layers: int | None = None,
) -> Path:
    """Convert `src` (an mlx-lm / Hugging Face folder, or a .gguf file) into a flashmoe folder at
    `out`; returns `out`. Does nothing if `out` is already complete.

    `layer_bits` overrides the experts' bits per layer: (layer, bits) pairs, or specs such as
    "first:2=4", "last:2=4", "3-5=8" (see parse_layer_bits).

    `expert_layout` (EXPERT_LAYOUTS): "auto" stores each layer's experts in the CPU kernels'
    tiles where those kernels compute them (layout.LayerExperts.layout), so a read lands ready
    to compute with no repack (the synthetic MoE at a quarter of its size in memory: 1.3-1.5x
    the decode speed); the MLX kernels put them back in rows as they land. "mlx" keeps MLX's
    row order everywhere; "tiles" is "auto" that fails where a layer cannot be tiled.
    """
    src, out = Path(src), Path(out)
    progress = progress or (lambda *a: None)
    if is_converted(out):
        progress("already converted", 1, 1)
        return out
    if out.exists():
        raise ConvertError(out, "exists and is not a finished flashmoe model; remove it or pick another path")
    if expert_layout not in EXPERT_LAYOUTS:
        raise ConvertError(src, f"expert layout {expert_layout!r} is not one of {', '.join(EXPERT_LAYOUTS)}")
    plan = QuantPlan(bits, group_size, expert_bits, tuple(l for l in layer_bits if not isinstance(l, str)))
    plan.check(src)
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ConvertError(src, f"dtype {dtype!r} is not supported (use {', '.join(FLOAT_DTYPES)})")
    if src.is_file() and src.suffix == ".gguf":
        return _convert_gguf(
            src, out, plan=plan, layer_bits=layer_bits, dtype=dtype, progress=progress, expert_layout=expert_layout
        )

    config = read_config(src)
    specs = [l for l in layer_bits if isinstance(l, str)]
    if specs:
        try:
            plan = QuantPlan(
                bits, group_size, expert_bits, parse_layer_bits(specs, text_config(config)["num_hidden_layers"])
            )
        except ValueError as e:
            raise ConvertError(src, str(e)) from None
        plan.check(src)
        layer_bits = plan.layer_bits
    files = _safetensors_files(src)
    headers = direct_headers(config, src, files)  # the config against the tensors, before building from it
    model = build_model(config, src)
    experts = switch_modules(model)
    check_expert_counts(config, src, headers, experts)
    reason = no_blocks_reason(model, config)
    if reason:  # never write a folder that silently keeps every expert resident
        raise ConvertError(src / "config.json", reason)
    weights = {}
    for f in files:
        weights.update(_mx_load(f))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)

    source_quant = config.get("quantization")
    quantize_like_checkpoint(model, config, weights)
    model.eval()
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ConvertError(src, f"weights do not match the config: {e}") from None
    del weights

    if dtype is not None:
        # Cast float tensors (weights of unquantized layers, scales and biases) before quantizing.
        target = FLOAT_DTYPES[dtype]
        model.update(
            tree_map(lambda p: p.astype(target) if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters())
        )
    if plan.active:
        if source_quant:
            if (
                (source_quant.get("bits"), source_quant.get("group_size")) == (bits, group_size)
                and expert_bits is None
                and not layer_bits
            ):
                plan = QuantPlan()  # already what was asked for
            else:
                raise ConvertError(
                    src,
                    f"already quantized ({source_quant.get('bits')}-bit); convert it "
                    "without --bits/--expert-bits, or start from the float checkpoint",
                )
    if plan.active:
        model, config = _quantize(model, config, plan)

    left = resident_expert_modules(model, declared_experts(config) or 0)
    if left:
        raise ConvertError(src, f"{left[0]} holds experts that would not stream (not one of mlx-lm's switch layers)")
    params = tree_flatten(model.parameters())
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))  # drop the model's references
    del model

    by_module: dict[str, list[tuple[str, mx.array]]] = {m: [] for m in experts}
    resident = []
    for name, a in params:
        module = expert_tensor_of(name, experts)
        if module is None:
            resident.append((name, a))
        else:
            by_module[module].append((name[len(module) + 1 :], a))
    del params

    work = out.with_name(out.name + ".partial")
    options = {
        "source": str(src.resolve()),
        "bits": bits,
        "group_size": group_size,
        "expert_bits": expert_bits,
        "layer_bits": [list(x) for x in layer_bits],
        "dtype": dtype,
        "expert_layout": expert_layout,
    }
    with _writing(work, work):
        _prepare_workdir(work, options)
        (work / EXPERTS_DIR).mkdir(exist_ok=True)

    modules = sorted(by_module, key=layer_index)
    total = len(modules) + 1
    layers: list[LayerExperts] = []
    for i, module in enumerate(modules):
        layer = layer_index(module)
        done = work / EXPERTS_DIR / (layer_file_name(layer) + ".json")
        parts = sorted(by_module.pop(module))
        finished = _finished_layer(done, work / EXPERTS_DIR / layer_file_name(layer))
        if finished is not None:
            layers.append(finished)
        else:
            if _fail_after_layers is not None and i >= _fail_after_layers:
                raise RuntimeError("injected failure (test)")
            tensors = dict(parts)
            mx.eval(list(tensors.values()))
            layout = _layout_for(expert_layout, experts[module], module, tensors, src)
            with _writing(work / EXPERTS_DIR / layer_file_name(layer), work):
                l = write_layer(
                    work / EXPERTS_DIR,
                    layer,
                    module,
                    tensors,
                    [n for n, _ in parts],
                    quantization=module_quantization(config, module),
                    layout=layout,
                )
                del tensors
                _write_json(done, _layer_to_json(l))
            layers.append(l)
        del parts
        progress(f"experts of layer {layer}", i + 1, total)

    with _writing(work / RESIDENT, work):
        write_streaming(work / RESIDENT, resident, metadata={"format": "mlx"})
    progress("resident weights", total, total)

    out_config = dict(config)
    out_config.pop("quantization_config", None)
    if "quantization" in out_config:
        out_config["quantization_config"] = out_config["quantization"]
    with _writing(work / "config.json", work):
        _write_json(work / "config.json", out_config)
    for f in src.iterdir():
        if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name not in _NOT_COPIED:
            with _writing(work / f.name, work):
                shutil.copyfile(f, work / f.name)
    with _writing(work / EXPERTS_DIR / MANIFEST, work):
        write_manifest(work / EXPERTS_DIR, layers, extra={"source_model_type": config["model_type"]})
    with _writing(out, work):
        for f in (work / EXPERTS_DIR).glob("*.bin.json"):
            f.unlink()
        (work / "options.json").unlink()
        (work / OWN_MARKER).unlink()
        os.replace(work, out)
    return out


# Inside OUT.partial, this file says a conversion made the folder: only then may a later run with
# other options delete it. A folder of that name without it is the user's, and is left alone.
OWN_MARKER = ".flashmoe-convert-partial"
_NO_ROOM = (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC))


@contextlib.contextmanager
def _writing(path: Path, work: Path):
    """A write that fails (a full disk, a file-size limit, a read-only folder) becomes one line
    naming the file; the finished layers stay in OUT.partial for the re-run to keep."""
    try:
        yield
    except OSError as e:
        fix = "free some space" if e.errno in _NO_ROOM else "fix that"
        raise ConvertError(
            path,
            f"cannot write: {e.strerror or e}; finished layers are kept in {work}: "
            f"{fix} and run the same command again",
        ) from None


def _prepare_workdir(work: Path, options: dict) -> None:
    """Keep an interrupted run's finished layers only if it used the same options; never touch a
    folder of that name that a conversion did not make."""
    if work.exists() or work.is_symlink():
        if work.is_symlink() or not (work / OWN_MARKER).is_file():
            raise ConvertError(
                work,
                "exists and was not made by flashmoe convert (it lacks "
                f"{OWN_MARKER}); move it away or pick another OUT",
            )
        try:
            same = read_json(work / "options.json") == options
        except ModelLoadError:
            same = False
        if not same:
            shutil.rmtree(work)
    if not work.exists():
        work.mkdir(parents=True)
        (work / OWN_MARKER).write_text("made by flashmoe convert; renamed to OUT when the conversion finishes\n")
    _write_json(work / "options.json", options)


def _write_json(path: Path, doc) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)


def _finished_layer(done: Path, file: Path) -> LayerExperts | None:
    """The layer an interrupted run finished (its .json note is written after its file), or None
    when it must be written (again): no note, or a note or file that does not hold up."""
    if not done.exists():
        return None
    try:
        l = _layer_from_json(read_json(done))
        if file.stat().st_size != l.stride * l.num_experts:
            return None
    except (ModelLoadError, OSError, KeyError, TypeError, ValueError):
        return None
    return l


EXPERT_LAYOUTS = ("auto", "mlx", "tiles")


def _layout_for(choice: str, block, module: str, tensors: dict, src: Path) -> str:
    """The layout a layer's experts are stored in (convert's `expert_layout`)."""
    from flashmoe.engine.experts.switch import _CpuExperts
    from flashmoe.engine.formats.safetensors_io import DTYPE_NAMES

    if choice == "mlx":
        return "mlx"
    parts = [Part(n, DTYPE_NAMES[t.dtype], tuple(t.shape[1:])) for n, t in tensors.items()]
    if _CpuExperts.tileable(block, parts):
        return "tiles"
    if choice == "tiles":
        raise ConvertError(
            src,
            f"--expert-layout tiles: the experts of {module} do not run on the CPU kernels' "
            "tiles (a SwiGLU of 2-, 4- or 8-bit affine projections, rows a multiple of 16)",
        )
    return "mlx"


def _layer_to_json(l: LayerExperts) -> dict:
    return {
        "layer": l.layer,
        "module": l.module,
        "num_experts": l.num_experts,
        "file": l.file,
        "stride": l.stride,
        "checksums": l.checksums,
        "quantization": l.quantization,
        "parts": [[p.name, p.dtype, list(p.shape)] for p in l.parts],
        "layout": l.layout,
    }


def _layer_from_json(d: dict) -> LayerExperts:
    parts = tuple(Part(n, dt, tuple(s)) for n, dt, s in d["parts"])
    return LayerExperts(
        d["layer"],
        d["module"],
        d["num_experts"],
        parts,
        file=d["file"],
        stride=d["stride"],
        checksums=d["checksums"],
        quantization=d.get("quantization"),
        layout=d.get("layout", "mlx"),
    )


FLOAT_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def module_quantization(config: dict, module: str) -> dict | None:
    """Bits and group size of an expert block's experts (its first projection), from the config."""
    q = config.get("quantization")
    if not q:
        return None
    per = next((v for k, v in q.items() if k.startswith(module + ".")), None)
    if per is False:
        return None
    if isinstance(per, dict):
        return {"bits": per["bits"], "group_size": per["group_size"]}
    return {"bits": q["bits"], "group_size": q["group_size"]}


def _quantize(model, config: dict, plan: QuantPlan):
    """mlx-lm's quantize_model, with expert bits per layer on top of the model's own rules."""
    from mlx_lm.utils import quantize_model

    own = getattr(model, "quant_predicate", None)
    experts = switch_modules(model)
    base_bits = plan.bits if plan.bits is not None else plan.expert_bits

    def predicate(path, module):
        switch = expert_tensor_of(path, experts)
        if switch is None:
            if plan.bits is None:
                return False  # only the experts were asked for
            return own(path, module) if own else True
        b = plan.expert_bits_for(layer_index(switch))
        if b is None:
            return False
        return {"group_size": plan.group_size, "bits": b, "mode": "affine"}

    with contextlib.redirect_stdout(io.StringIO()):  # it prints a line of its own
        return quantize_model(model, config, plan.group_size, base_bits, quant_predicate=predicate)


def _convert_gguf(src: Path, out: Path, *, plan: QuantPlan, layer_bits, dtype, progress, expert_layout: str) -> Path:
    """GGUF: dequantize into a float Hugging Face folder beside OUT, then convert that."""
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    stage = out.with_name(out.name + ".gguf-src")
    if (stage.exists() or stage.is_symlink()) and not (stage / OWN_MARKER).is_file():
        raise ConvertError(
            stage,
            f"exists and was not made by flashmoe convert (it lacks {OWN_MARKER}); move it away or pick another OUT",
        )
    if not (stage / "config.json").exists():
        progress("reading the GGUF", 0, 1)
        with _writing(stage, stage):
            stage.mkdir(parents=True, exist_ok=True)
            (stage / OWN_MARKER).write_text("made by flashmoe convert from a GGUF; removed when it finishes\n")
        try:
            with _writing(stage, stage):
                gguf_to_hf_folder(src, stage)
        except ValueError as e:
            shutil.rmtree(stage, ignore_errors=True)
            raise ConvertError(src, str(e)) from None
    result = convert(
        stage,
        out,
        bits=plan.bits,
        group_size=plan.group_size,
        expert_bits=plan.expert_bits,
        layer_bits=layer_bits,
        dtype=dtype,
        progress=progress,
        expert_layout=expert_layout,
    )
    shutil.rmtree(stage, ignore_errors=True)
    return result
