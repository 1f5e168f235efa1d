"""flashmoe convert: an mlx-lm folder in, a flashmoe model folder out.

Tensors flow one at a time: the source is opened lazily (mx.load maps nothing until a tensor is
evaluated), mlx-lm's own sanitize and quantize build lazy results, and we evaluate and write each
result and drop it. Peak memory is about one layer's experts plus one resident tensor.

The output is built in OUT.partial and renamed to OUT at the end, so OUT either is complete or
does not exist. Finished layers survive an interruption and are not redone.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from .errors import ConvertError
from .experts.layout import MANIFEST, LayerExperts, Part, layer_file_name, write_layer, write_manifest
from .loader import (EXPERTS_DIR, RESIDENT, _mx_load, _safetensors_files, build_model, layer_index,
                     quantize_like_checkpoint, read_config, switch_modules)
from .safetensors_io import write_streaming

# Files copied as they are: tokenizer, chat template, generation settings.
_COPY_SUFFIXES = (".json", ".jinja", ".model", ".txt", ".tiktoken")
_NOT_COPIED = {"config.json", "model.safetensors.index.json"}

Progress = Callable[[str, int, int], None]


def is_converted(path: Path) -> bool:
    return (path / "config.json").exists() and (path / RESIDENT).exists() and \
        (path / EXPERTS_DIR / MANIFEST).exists()


def convert(src: str | Path, out: str | Path, *, bits: int | None = None, group_size: int = 64,
            progress: Progress | None = None, _fail_after_layers: int | None = None) -> Path:
    """Convert `src` into a flashmoe folder at `out`; returns `out`. Does nothing if `out` is done."""
    src, out = Path(src), Path(out)
    progress = progress or (lambda *a: None)
    if is_converted(out):
        progress("already converted", 1, 1)
        return out
    if out.exists():
        raise ConvertError(out, "exists and is not a finished flashmoe model; remove it or pick another path")
    if bits is not None and bits not in (2, 3, 4, 5, 6, 8):
        raise ConvertError(src, f"--bits {bits} is not supported (use 2, 3, 4, 5, 6 or 8)")
    if group_size not in (32, 64, 128):
        raise ConvertError(src, f"--group-size {group_size} is not supported (use 32, 64 or 128)")

    config = read_config(src)
    files = _safetensors_files(src)
    model = build_model(config, src)
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

    if bits is not None:
        if source_quant:
            if (source_quant.get("bits"), source_quant.get("group_size")) == (bits, group_size):
                bits = None  # already what was asked for
            else:
                raise ConvertError(src, f"already quantized ({source_quant.get('bits')}-bit); "
                                   "convert it without --bits, or start from the float checkpoint")
    if bits is not None:
        from mlx_lm.utils import quantize_model

        with contextlib.redirect_stdout(io.StringIO()):  # it prints a line of its own
            model, config = quantize_model(model, config, group_size, bits)

    experts = switch_modules(model)
    if not experts:
        raise ConvertError(src, f"{config['model_type']} has no routed experts (no switch_mlp): nothing to stream")
    params = tree_flatten(model.parameters())
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))  # drop the model's references
    del model

    by_module: dict[str, list[tuple[str, mx.array]]] = {m: [] for m in experts}
    resident = []
    for name, a in params:
        module = next((m for m in experts if name.startswith(m + ".")), None)
        if module is None:
            resident.append((name, a))
        else:
            by_module[module].append((name[len(module) + 1:], a))
    del params

    work = out.with_name(out.name + ".partial")
    options = {"source": str(src.resolve()), "bits": bits, "group_size": group_size}
    _prepare_workdir(work, options)
    (work / EXPERTS_DIR).mkdir(exist_ok=True)

    modules = sorted(by_module, key=layer_index)
    total = len(modules) + 1
    layers: list[LayerExperts] = []
    for i, module in enumerate(modules):
        layer = layer_index(module)
        done = work / EXPERTS_DIR / (layer_file_name(layer) + ".json")
        parts = sorted(by_module.pop(module))
        if done.exists():
            layers.append(_layer_from_json(json.loads(done.read_text())))
        else:
            if _fail_after_layers is not None and i >= _fail_after_layers:
                raise RuntimeError("injected failure (test)")
            tensors = dict(parts)
            mx.eval(list(tensors.values()))
            l = write_layer(work / EXPERTS_DIR, layer, module, tensors, [n for n, _ in parts])
            del tensors
            _write_json(done, _layer_to_json(l))
            layers.append(l)
        del parts
        progress(f"experts of layer {layer}", i + 1, total)

    write_streaming(work / RESIDENT, resident, metadata={"format": "mlx"})
    progress("resident weights", total, total)

    out_config = dict(config)
    out_config.pop("quantization_config", None)
    if "quantization" in out_config:
        out_config["quantization_config"] = out_config["quantization"]
    _write_json(work / "config.json", out_config)
    for f in src.iterdir():
        if f.is_file() and f.suffix in _COPY_SUFFIXES and f.name not in _NOT_COPIED:
            shutil.copyfile(f, work / f.name)
    write_manifest(work / EXPERTS_DIR, layers, extra={"source_model_type": config["model_type"]})
    for f in (work / EXPERTS_DIR).glob("*.bin.json"):
        f.unlink()
    (work / "options.json").unlink()
    os.replace(work, out)
    return out


def _prepare_workdir(work: Path, options: dict) -> None:
    """Keep an interrupted run's finished layers only if it used the same options."""
    marker = work / "options.json"
    if work.exists():
        try:
            same = json.loads(marker.read_text()) == options
        except (OSError, json.JSONDecodeError):
            same = False
        if not same:
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    _write_json(marker, options)


def _write_json(path: Path, doc) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)


def _layer_to_json(l: LayerExperts) -> dict:
    return {"layer": l.layer, "module": l.module, "num_experts": l.num_experts, "file": l.file,
            "stride": l.stride, "checksums": l.checksums,
            "parts": [[p.name, p.dtype, list(p.shape)] for p in l.parts]}


def _layer_from_json(d: dict) -> LayerExperts:
    parts = tuple(Part(n, dt, tuple(s)) for n, dt, s in d["parts"])
    return LayerExperts(d["layer"], d["module"], d["num_experts"], parts, file=d["file"],
                        stride=d["stride"], checksums=d["checksums"])
