"""What a model folder holds, read from its config, manifest and safetensors headers only."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from flashmoe.engine.experts.layout import read_manifest
from flashmoe.engine.experts.blocks import (
    cpu_kernels_reason,
    expert_blocks,
    expert_tensor_of,
    kind,
    layer_index,
    no_blocks_reason,
)
from flashmoe.engine.runtime.loader import (
    EXPERTS_DIR,
    RESIDENT,
    _direct_layers,
    _safetensors_files,
    build_model,
    memory_plan,
    read_config,
    resident_bytes,
    text_config,
    top_k_of,
)
from flashmoe.engine.runtime.memory import MemoryTooSmall
from flashmoe.engine.formats.safetensors_io import read_header


def describe(path: str | Path, upcast: bool = True, ctx_size: int | None = None) -> dict:
    """`upcast`: 16-bit floats widened to float32 as loaded (the CPU default), for the memory plan."""
    path = Path(path)
    config = read_config(path)
    c = text_config(config)
    packed = (path / RESIDENT).exists()
    model = build_model(config, path)  # lazy: nothing is computed, it only says where the experts are
    blocks = expert_blocks(model)
    if packed:
        tensors = list(read_header(path / RESIDENT).values())
        resident = sum(t.nbytes for t in tensors)
        manifest = read_manifest(path / EXPERTS_DIR)
        layers = [(l.layer, l.num_experts, l.expert_bytes) for l in manifest]
        modules = {l.layer: l.module for l in manifest}
    else:
        headers = {}
        for f in _safetensors_files(path):
            headers.update(read_header(f))
        tensors = [t for k, t in headers.items() if not expert_tensor_of(k, blocks)]
        resident = sum(t.nbytes for t in tensors)
        manifest = _direct_layers(path, blocks, headers, c.get("model_type", config["model_type"])) if blocks else []
        per_module = defaultdict(lambda: [0, 0])
        for k, t in headers.items():
            b = expert_tensor_of(k, blocks)
            if b and t.shape:
                per_module[b][0] = t.shape[0]
                per_module[b][1] += t.nbytes // t.shape[0]
        layers = sorted((layer_index(m), e, b) for m, (e, b) in per_module.items())
        modules = {layer_index(m): m for m in per_module}
    from flashmoe.engine.formats.convert import module_quantization

    q = config.get("quantization") or {}
    k = top_k_of(config)
    expert_bits: dict = {}
    compute: dict = {}
    for layer, _, _ in layers:
        mq = module_quantization(config, modules[layer])
        expert_bits.setdefault(mq["bits"] if mq else None, []).append(layer)
        block = blocks.get(modules[layer])
        if block is not None:
            why = cpu_kernels_reason(block, quantized=mq is not None)
            how = "CPU kernels" if why is None else f"MLX (the CPU kernels do not run {why})"
            compute.setdefault(f"{kind(block)} on {how}", []).append(layer)
    expert_total = sum(e * b for _, e, b in layers)
    try:
        memory = memory_plan(config, manifest, resident_bytes(tensors, upcast), upcast=upcast, ctx_size=ctx_size)
        memory = {
            "rows": [list(r) for r in memory.lines()],
            "expert_cache_bytes": memory.expert_cache,
            "available_bytes": memory.limit.available,
            "context": memory.context,
            "notes": list(memory.notes),
            "other_limits": list(memory.limit.others),
        }
    except MemoryTooSmall as e:
        memory = {"refused": str(e)}
    return {
        "path": str(path),
        "format": "flashmoe (packed experts)" if packed else "mlx-lm folder (direct mode)",
        "model_type": config["model_type"],
        "layers": c.get("num_hidden_layers"),
        "moe_layers": len(layers),
        "experts": layers[0][1] if layers else 0,
        "top_k": k,
        "bits": q.get("bits"),
        "group_size": q.get("group_size"),
        "hidden_size": c.get("hidden_size"),
        "vocab_size": c.get("vocab_size"),
        "resident_bytes": resident,
        "expert_bytes": expert_total,
        "expert_block_bytes": layers[0][2] if layers else 0,
        "bytes_per_token_cold": sum(min(k, e) * b for _, e, b in layers),
        "expert_bits": {str(b): ls for b, ls in expert_bits.items()},
        # which code computes the experts under --kernels cpu: the numba kernels or MLX's own
        "expert_compute": compute,
        "not_streamable": None if blocks else no_blocks_reason(model, config),
        "memory": memory,
    }


def expert_bits_summary(expert_bits: dict) -> str:
    """{"2": [1], "4": [0, 2]} -> '2-bit (layer 1), 4-bit (layers 0, 2)'."""
    parts = []
    for bits, layers in sorted(expert_bits.items(), key=lambda kv: (kv[0] == "None", kv[0])):
        name = "float" if bits == "None" else f"{bits}-bit"
        parts.append(f"{name} ({layers_text(layers)})")
    return ", ".join(parts)


def layers_text(layers: list[int]) -> str:
    """[1] -> 'layer 1'; [0, 1, 2, 5] -> 'layers 0-2, 5'."""
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {_ranges(layers)}"


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}" if x > start + 1 else f"{start}, {x}")
            start = None
    return ", ".join(out)
