"""load(path): an mlx-lm model whose MoE layers stream their experts from disk.

Two kinds of folder load the same way:
- packed (the output of `flashmoe convert`): resident.safetensors + experts/ + manifest;
- direct: an unconverted mlx-lm folder; experts are read out of the stacked `switch_mlp`
  tensors of its safetensors files at the offsets their headers give, with no repack.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn

from flashmoe.engine.runtime.config_check import check_values, check_against_weights, context_length
from flashmoe.engine.errors import ModelLoadError, OptionError
from flashmoe.engine.experts.blocks import (
    declared_experts,
    expert_blocks,
    expert_params,
    expert_tensor_of,
    kind,
    layer_index,
    no_blocks_reason,
    resident_expert_modules,
)
from flashmoe.engine.experts.layout import LayerExperts, Part, read_manifest
from flashmoe.engine.experts.store import ExpertStore
from flashmoe.engine.experts.switch import StreamingSwitchGLU, _CpuExperts
from flashmoe.engine.runtime.jsonfile import read_json
from flashmoe.engine.runtime.memory import (
    MemoryPlan,
    MemoryTooSmall,
    kv_bytes_per_token,
    plan,
    read_limit,
    working_bytes,
)
from flashmoe.engine.options import IO_THREADS, KV_CACHES, PREFETCH_MODES
from flashmoe.engine.telemetry import Telemetry
from flashmoe.engine.formats.safetensors_io import read_header

log = logging.getLogger("flashmoe")

RESIDENT = "resident.safetensors"
EXPERTS_DIR = "experts"


@dataclass
class LoadedModel:
    model: nn.Module
    config: dict
    path: Path
    mode: str  # "packed" or "direct"
    store: ExpertStore | None
    layers: list[LayerExperts]
    telemetry: Telemetry = field(default_factory=Telemetry)  # shared with the streaming modules
    tokenizer: object = None
    kernels: str = "mlx"  # which matmul kernels run: "mlx" or "cpu"
    int8_matrices: int = 0  # --kernels cpu-int8: resident matrices multiplied on int8 activations
    kv_cache: str = "float32"  # the CPU kernels' KV cache element type (options.KV_CACHES)
    clock: object = None  # timing.LayerClock, installed on the first --timing layer request
    fused: dict = field(default_factory=dict)  # cpu kernels: attention / MLP blocks fused (engine/cpu/fused.py)
    block_kinds: dict = field(default_factory=dict)  # expert block path -> its class and activation
    switches: dict = field(default_factory=dict)  # expert block path -> its StreamingSwitchGLU (the fused
    # CPU blocks hold them too, out of the module tree)
    resident_experts: str | None = None  # why the experts are in memory (--allow-resident-experts)
    trained_top_k: int | None = None  # the config's experts per token, when --experts-per-token changed it
    memory: MemoryPlan | None = None  # the shares of what the process may use (runtime/memory.py)

    @property
    def context(self) -> int | None:
        """The longest prompt and reply the KV cache is planned for: the memory plan's context
        (--ctx-size, or what the budget allows), else the model's own."""
        return self.memory.context if self.memory is not None else context_length(self.config)

    @property
    def top_k(self) -> int:
        return top_k_of(self.config)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


def text_config(config: dict) -> dict:
    """Multimodal configs (Qwen3.5) keep the language model's settings under text_config."""
    return {**config, **config.get("text_config", {})}


def top_k_of(config: dict) -> int:
    c = text_config(config)
    for key in ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts"):
        if isinstance(c.get(key), int):
            return c[key]
    return 1


TOP_K_KEYS = ("num_experts_per_tok", "moe_top_k", "top_k", "num_selected_experts")


def num_experts_of(config: dict) -> int | None:
    c = text_config(config)
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"):
        if isinstance(c.get(key), int):
            return c[key]
    return None


def with_experts_per_token(config: dict, k: int, where: Path) -> dict:
    """The config with its experts-per-token set to `k` (where the config keeps it: top level or
    text_config), so mlx-lm's own model routes to k experts; a model with no such key, or a k
    outside 1..experts, is refused by name."""
    import copy

    experts = num_experts_of(config)
    out = copy.deepcopy(config)
    found = False
    for d in (out, out.get("text_config")):
        for key in TOP_K_KEYS:
            if isinstance(d, dict) and isinstance(d.get(key), int):
                d[key] = k
                found = True
    if not found:
        raise OptionError(
            f"--experts-per-token: {where / 'config.json'} names no experts-per-token setting ({', '.join(TOP_K_KEYS)})"
        )
    if not 1 <= k <= (experts or k):
        raise OptionError(f"--experts-per-token {k}: this model has {experts} experts per layer")
    return out


def read_config(path: Path) -> dict:
    cfg = path / "config.json"
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    if not path.is_dir():
        raise ModelLoadError(path, "not a model folder (it is a file; give the folder that holds config.json)")
    if not cfg.exists() and not cfg.is_symlink():
        raise ModelLoadError(path, "not a model folder: no config.json")
    config = read_json(cfg, expect=None)
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(cfg, "no model_type: this is not a model config")
    try:
        normalize_config(config)
        if isinstance(config.get("text_config"), dict):
            normalize_config(config["text_config"])
    except ValueError as e:
        raise ModelLoadError(cfg, str(e)) from None
    except RecursionError:
        raise ModelLoadError(cfg, "not valid JSON for a model (nested too deeply)") from None
    check_values(config, cfg)
    gen = path / "generation_config.json"
    if gen.exists():
        eos = read_json(gen).get("eos_token_id")
        if eos is not None:
            config["eos_token_id"] = eos
    return config


# Model types whose originals name their layer kinds the old way, as mlx-lm reads them, where
# transformers 5 writes its new names (its _LEGACY_LAYER_TYPE_REMAP, reversed).
_LEGACY_LAYER_TYPES = {"granitemoehybrid": {"linear_attention": "mamba", "full_attention": "attention"}}


def _json_floats(v):
    """transformers 5 writes a non-finite float as {"__float__": "Infinity"}; the originals as Infinity."""
    if isinstance(v, dict):
        if len(v) == 1 and isinstance(v.get("__float__"), str):
            try:
                return float(v["__float__"])
            except ValueError:
                return v
        return {k: _json_floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_json_floats(x) for x in v]
    return v


def normalize_config(c: dict) -> None:
    """Add the classic key names mlx-lm reads where a config has only the new ones.

    transformers 5 nests rope settings under `rope_parameters` (and drops `rope_scaling`: null
    where there is none), calls the expert count `num_local_experts` for Qwen3-MoE, lists
    `layer_types` instead of an attention interval (and under its new names: granitemoehybrid's
    "mamba" layers are "linear_attention"; exaone_moe's is_moe_layer is mlp_layer_types), folds
    Gemma 4's global_head_dim into per_layer_config, and writes a non-finite float as
    {"__float__": "Infinity"}. Without this, some models fail to load and others silently use a
    default rope_theta.
    """
    for key, v in c.items():
        c[key] = _json_floats(v)
    rope = c.get("rope_parameters")
    if isinstance(rope, dict):
        for key in ("rope_theta", "partial_rotary_factor"):
            if key not in c and key in rope:
                c[key] = rope[key]
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default" and not c.get("rope_scaling"):
            c["rope_scaling"] = {**rope, "type": kind, "rope_type": kind}
        c.setdefault("rope_scaling", None)  # classic configs say null (some mlx-lm models require the key)
    if "num_experts" not in c and "num_local_experts" in c and c.get("model_type") != "mixtral":
        c["num_experts"] = c["num_local_experts"]
    kinds = c.get("layer_types")
    per_layer = c.get("per_layer_config")
    if c.get("model_type") in ("gemma4", "gemma4_text") and isinstance(per_layer, dict) and isinstance(kinds, list):
        # transformers 5.24 folds Gemma 4's global_head_dim / num_global_key_value_heads into
        # per_layer_config overrides of its full-attention layers
        full = [per_layer.get(str(i), per_layer.get(i)) for i, k in enumerate(kinds) if k == "full_attention"]
        for key, classic in (("head_dim", "global_head_dim"), ("num_key_value_heads", "num_global_key_value_heads")):
            values = {o.get(key) if isinstance(o, dict) else None for o in full}
            if classic not in c and len(values) == 1 and None not in values:
                c[classic] = values.pop()
    mlp_kinds = c.get("mlp_layer_types")
    if c.get("model_type") == "exaone_moe" and "is_moe_layer" not in c and isinstance(mlp_kinds, list):
        c["is_moe_layer"] = [k == "sparse" for k in mlp_kinds]  # transformers 5's name for K-EXAONE's list
    if c.get("model_type") in _LEGACY_LAYER_TYPES and isinstance(kinds, list):
        c["layer_types"] = kinds = [_LEGACY_LAYER_TYPES[c["model_type"]].get(k, k) for k in kinds]
    if "full_attention_interval" not in c and isinstance(kinds, list) and "linear_attention" in kinds:
        full = [i for i, k in enumerate(kinds) if k == "full_attention"]
        if full:
            n = full[0] + 1
            if full != list(range(n - 1, len(kinds), n)):
                raise ValueError("layer_types is not periodic: mlx-lm needs one full-attention layer every N layers")
            c["full_attention_interval"] = n


def model_classes(config: dict, cfg_path: Path):
    """mlx-lm's class for model_type, honouring its remapping table."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError:
        import mlx_lm

        raise ModelLoadError(
            cfg_path,
            f"unknown model_type {config['model_type']!r} (mlx-lm {mlx_lm.__version__} has no such architecture)",
        ) from None


def build_model(config: dict, path: Path) -> nn.Module:
    model_class, args_class = model_classes(config, path / "config.json")
    try:
        return model_class(args_class.from_dict(config))
    except (TypeError, KeyError, ValueError, ArithmeticError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            path / "config.json", f"does not describe a valid {config['model_type']} model ({first})"
        ) from None


def switch_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every routed-expert block (SwitchGLU / SwitchMLP, whatever its attribute name) by path."""
    return expert_blocks(model)


def _shape_proxy(shape, dtype):
    # infer_quant_config only looks at .shape and .dtype, so expert tensors need not be loaded.
    return SimpleNamespace(shape=tuple(shape), dtype=dtype)


def quantize_like_checkpoint(model: nn.Module, config: dict, shapes: dict) -> None:
    """Quantize the modules the checkpoint stores quantized, as mlx-lm's loader decides it."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if not quantization or "bits" not in quantization:
        return
    from mlx_lm.utils import infer_quant_config

    def predicate(p, m):
        if p in quantization:
            return quantization[p]
        if not hasattr(m, "to_quantized") or f"{p}.scales" not in shapes:
            return False
        return infer_quant_config(p, m, shapes)

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(index, "malformed index (weight_map must map tensor names to file names)")
        names = sorted(set(weight_map.values()))
        files = [path / n for n in names]
        for f in files:
            if not f.exists():
                raise ModelLoadError(f, "missing (listed in model.safetensors.index.json)")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "not a model folder: no .safetensors files")
    return files


def _mx_load(f: Path) -> dict:
    try:
        return mx.load(str(f))
    except Exception as e:  # MLX raises RuntimeError/ValueError with its own text
        raise ModelLoadError(f, f"cannot load safetensors ({e})") from None


# Hugging Face names of one expert's projections in per-expert checkpoints: mlx-lm's name first,
# then what the originals call it (Mixtral w1/w3/w2; nemotron_h's up/down for fc1/fc2).
_EXPERT_ALIASES = {
    "gate_proj": ("gate_proj", "w1"),
    "up_proj": ("up_proj", "w3"),
    "down_proj": ("down_proj", "w2"),
    "fc1": ("fc1", "up_proj"),
    "fc2": ("fc2", "down_proj"),
}
# Where the originals keep expert e beside the block: `experts.e` (most), `mlp.e` (phixtral).
_EXPERT_LISTS = ("experts", "mlp")


def _original_bases(module: str) -> set[str]:
    """The block's parent path as the original checkpoint may spell it."""
    base = module.rpartition(".")[0]
    return {base, base.replace("language_model.model.", "model.language_model.")}


def _per_expert_keys(module: str, part: str, expert: int) -> list[str]:
    """Candidate names of one expert's tensor in an unsanitized (per-expert) checkpoint."""
    proj, _, leaf = part.partition(".")
    return [
        f"{b}.{lst}.{expert}.{alias}.{leaf}"
        for b in _original_bases(module)
        for lst in _EXPERT_LISTS
        for alias in _EXPERT_ALIASES.get(proj, (proj,))
    ]


# Model types whose originals fuse gate and up as gate_up_proj [E, 2I, H] (granitemoe's
# input_linear.weight), gate rows first (their sanitize splits axis -2 in halves), with down_proj
# [E, H, I] (output_linear.weight): each half of an expert is contiguous, so it streams in
# place. Others fuse differently (gpt_oss interleaves the rows, llama4 and qwen3_vl_moe store
# them transposed): those go through `flashmoe convert`.
FUSED_IN_PLACE = (
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "mistral4",
    "gemma4",
    "gemma4_text",
    "granitemoe",
    "granitemoehybrid",
)
_FUSED_NAMES = {
    "granitemoe": ("input_linear.weight", "output_linear.weight"),
    "granitemoehybrid": ("input_linear.weight", "output_linear.weight"),
}


def _fused_slices(module: str, part: str, num_experts: int, headers: dict, model_type: str):
    """One part's slices in a fused gate_up_proj / down_proj original, or None."""
    proj, _, leaf = part.partition(".")
    if leaf != "weight" or proj not in ("gate_proj", "up_proj", "down_proj") or model_type not in FUSED_IN_PLACE:
        return None
    gate_up, down = _FUSED_NAMES.get(model_type, ("gate_up_proj", "down_proj"))
    name = down if proj == "down_proj" else gate_up
    for b in _original_bases(module):
        t = next((headers[k] for k in (f"{b}.experts.{name}", f"{b}.{name}") if k in headers), None)
        if t is None or t.shape[0] != num_experts or len(t.shape) != 3:
            continue
        per = t.nbytes // num_experts
        if proj == "down_proj":
            return Part(part, t.dtype, tuple(t.shape[1:])), [
                (str(t.path), t.offset + e * per) for e in range(num_experts)
            ]
        rows = t.shape[1] // 2
        half = per // 2
        skip = half if proj == "up_proj" else 0
        return (
            Part(part, t.dtype, (rows, *t.shape[2:])),
            [(str(t.path), t.offset + e * per + skip) for e in range(num_experts)],
        )
    return None


def router_weights(model: nn.Module, layers: list[LayerExperts]) -> dict:
    """Each MoE layer's router as a float32 matrix [E, H]: the `gate` (or `router`) beside its
    expert block, or beside the block's parent (gemma4's experts.switch_glu)."""
    import numpy as np

    modules = dict(model.named_modules())
    out = {}
    for l in layers:
        parent = l.module.rpartition(".")[0]
        near = [parent, parent.rpartition(".")[0]]
        gate = next(
            (
                modules[k]
                for p in near
                for k in (f"{p}.gate", f"{p}.router", f"{p}.router.proj")
                if isinstance(modules.get(k), nn.Linear) or "weight" in modules.get(k, {})
            ),
            None,
        )
        if gate is None or "weight" not in gate:
            continue
        w = gate["weight"]
        if "scales" in gate:
            w = mx.dequantize(w, gate["scales"], gate.get("biases"), gate.group_size, gate.bits)
        w = w.astype(mx.float32)
        mx.eval(w)
        if w.shape[0] == l.num_experts:
            out[l.layer] = np.array(w)
    return out


def _exists(p: Path) -> bool:
    return p.exists() or p.is_symlink()  # a dangling link is there, and fails later naming it


def direct_headers(config: dict, path: Path, files: list[Path]) -> dict:
    """Every tensor header of an mlx-lm / Hugging Face folder, the config checked against them
    (the expert counts are checked once the model says where its expert blocks are)."""
    headers = {k: v for f in files for k, v in read_header(f).items()}
    check_against_weights(config, path / "config.json", {k: t.shape for k, t in headers.items()}, {})
    return headers


def check_expert_counts(config: dict, path: Path, headers: dict, blocks) -> None:
    """How many experts the files hold for each block (stacked or fused tensors), against the config.

    Per-expert tensors under the block's own path (`mlp.experts.0.gate_proj.weight` where the
    block is `mlp.experts`) are one expert each: their first axis is a width, not a count."""
    counts = {}
    for b in blocks:
        t = next(
            (
                t
                for k, t in headers.items()
                if k.startswith(b + ".") and t.shape and not k[len(b) + 1 :].split(".")[0].isdigit()
            ),
            None,
        )
        if t is not None:
            counts[b] = t.shape[0]
    if counts:
        check_against_weights(config, path / "config.json", {k: t.shape for k, t in headers.items()}, counts)


def _direct_layers(path: Path, blocks: dict, headers: dict, model_type: str) -> list[LayerExperts]:
    """Locate every expert slice in the checkpoint's own files: stacked [E, ...] tensors
    (mlx-lm layout), one tensor per expert (Hugging Face layout) or fused gate_up halves."""
    layers = []
    for module, m in blocks.items():
        parts, sources = [], []
        for name, arr in expert_params(m):
            num_experts = arr.shape[0]
            key = f"{module}.{name}"
            info = headers.get(key)
            if info is not None:
                if info.shape[0] != num_experts or info.nbytes % num_experts:
                    raise ModelLoadError(
                        info.path, f"{key} has shape {list(info.shape)}, expected {num_experts} experts"
                    )
                per = info.nbytes // num_experts
                parts.append(Part(name, info.dtype, tuple(info.shape[1:])))
                sources.append([(str(info.path), info.offset + e * per) for e in range(num_experts)])
                continue
            fused = _fused_slices(module, name, num_experts, headers, model_type)
            if fused is not None:
                part, srcs = fused
                parts.append(part)
                sources.append(srcs)
                continue
            slices = []
            for e in range(num_experts):
                found = next((headers[k] for k in _per_expert_keys(module, name, e) if k in headers), None)
                if found is None:
                    raise ModelLoadError(path, _no_expert_tensor(module, key, e, headers, model_type))
                if e and (found.dtype, found.shape) != (slices[0].dtype, slices[0].shape):
                    raise ModelLoadError(found.path, f"{found.name} differs in shape or dtype from expert 0")
                slices.append(found)
            parts.append(Part(name, slices[0].dtype, tuple(slices[0].shape)))
            sources.append([(str(t.path), t.offset) for t in slices])
        layers.append(LayerExperts(layer_index(module), module, num_experts, tuple(parts), sources=sources))
    return layers


def _stacked_name(k: str, module: str) -> bool:
    """k is one of the block's own stacked tensors as mlx-lm names them (module.gate_proj.weight)."""
    rest = k[len(module) + 1 :].split(".") if k.startswith(module + ".") else []
    return len(rest) == 2 and rest[0] in _EXPERT_ALIASES


def _no_expert_tensor(module: str, key: str, expert: int, headers: dict, model_type: str) -> str:
    # A 3-d tensor beside or under the block that is not mlx-lm's stacked layout: the original's
    # fused or transposed experts (gpt_oss's and llama4's experts.gate_up_proj / down_proj).
    near = sorted(
        k
        for k in headers
        if any(k.startswith(b + ".") for b in _original_bases(module))
        and not _stacked_name(k, module)
        and len(headers[k].shape) == 3
    )
    if near:
        return (
            f"{near[0]} holds {model_type}'s experts in a layout direct mode cannot read in place "
            "(fused or transposed); run `flashmoe convert` on this folder"
        )
    return (
        f"no expert tensor for {key} (expert {expert}): direct mode reads stacked or per-expert "
        "checkpoints; run `flashmoe convert` on this folder"
    )


def _check_layer_shapes(layers, modules, where: Path) -> None:
    for l in layers:
        m = modules.get(l.module)
        if m is None:
            raise ModelLoadError(where, f"layer {l.layer}: module {l.module} does not exist in this model")
        want = {n: tuple(a.shape[1:]) for n, a in expert_params(m)}
        have = {p.name: p.shape for p in l.parts}
        if want != have:
            raise ModelLoadError(
                where, f"layer {l.layer}: expert tensors {have} do not match the model config, which wants {want}"
            )


def _check_blocks(model, config: dict, blocks: dict, manifest, where: Path, allow_resident: bool) -> None:
    """A model that declares experts must have blocks that stream, and a packed folder must have
    streamed all of them (one converted by a flashmoe that kept some resident did not)."""
    if not blocks:
        reason = no_blocks_reason(model, config)
        if reason and not allow_resident:
            raise ModelLoadError(
                where if manifest is not None else where / "config.json",
                f"{reason}; load with --allow-resident-experts to keep them in memory",
            )
        return
    if manifest is not None and not manifest:
        raise ModelLoadError(
            where,
            f"this folder holds no streamed experts, but the model has {len(blocks)} "
            f"expert blocks ({next(iter(blocks))}, ...): it was converted by an older flashmoe "
            "that kept them resident; convert the source again",
        )


def _replace(model, modules: dict, path: str, new) -> None:
    """Put `new` where the module at `path` is (an attribute, or an item of a list of layers)."""
    parent_path, _, attr = path.rpartition(".")
    parent = modules[parent_path] if parent_path else model
    if isinstance(parent, list):
        parent[int(attr)] = new
    else:
        setattr(parent, attr, new)


def resident_bytes(tensors, upcast: bool) -> int:
    """What the resident tensors take once loaded: 16-bit floats twice their size when widened."""
    return sum(t.nbytes * (2 if upcast and t.dtype in ("BF16", "F16") else 1) for t in tensors)


def memory_plan(
    config: dict,
    layers: list[LayerExperts],
    resident: int,
    *,
    upcast: bool,
    kv_cache: str = "float32",
    io_threads: int = IO_THREADS,
    expert_cache: int | None = None,
    ctx_size: int | None = None,
    prompt_cache: int = 0,
    limit=None,
    keep_bf16=None,
) -> MemoryPlan:
    """The memory plan (runtime/memory.py) for a model of `config` whose streamed experts are
    `layers` and whose resident weights take `resident` bytes, under `limit` (read now if None).
    Raises MemoryTooSmall when the resident part does not fit."""
    from flashmoe.engine.experts.store import held_parts

    c = text_config(config)
    k = top_k_of(config)
    keep = keep_bf16 or (lambda layer: False)
    held = {l.signature: sum(p.nbytes for p in held_parts(l.parts, upcast, keep(l))) for l in layers}
    by_layer = [held[l.signature] for l in layers]
    all_experts = sum(b * l.num_experts for b, l in zip(by_layer, layers))
    min_experts = sum(min(k, max(l.num_experts for l in layers)) * b for b in held.values())
    dtype_bytes = 2 if kv_cache == "float16" or not upcast else 4
    return plan(
        read_limit() if limit is None else limit,
        resident=resident,
        working=working_bytes(c, k, 512, io_threads, max(by_layer, default=0)),
        kv_per_token=kv_bytes_per_token(c, dtype_bytes),
        model_context=context_length(config),
        all_experts=all_experts,
        min_experts=min_experts,
        ctx_size=ctx_size,
        prompt_cache=prompt_cache,
        expert_cache=expert_cache,
    )


def load(
    path: str | Path,
    *,
    expert_cache: int | None = None,
    io_threads: int = IO_THREADS,
    direct_io: bool | None = None,
    load_tokenizer: bool = True,
    dtype: str | None = None,
    kernels: str = "mlx",
    prefetch: bool | str = False,
    cache_policy: str = "lfu",
    verify_reads: bool = True,
    allow_resident_experts: bool = False,
    experts_per_token: int | None = None,
    kv_cache: str = "float32",
    ctx_size: int | None = None,
    prompt_cache: int = 0,
    memory_limit=None,
) -> LoadedModel:
    """Build the model for `path` with streamed experts. Resident weights are loaded here.

    dtype "float32" widens 16-bit float tensors (weights, quantization scales and biases, and
    experts as they are read): MLX's CPU kernels are much faster in float32, and its CPU
    gather_mm takes nothing else. None keeps what the checkpoint stores.

    kernels "cpu" runs every affine quantized matmul on the numba CPU kernels (engine/cpu/install.py;
    it implies float32), "mlx" on MLX's own, "auto" picks cpu when MLX runs on the CPU. "cpu-int8"
    is "cpu" with the tiled matrices (resident and streamed experts, decode and prefill) on
    rounded activations (two int8 terms with AVX-512 VNNI, one int16 term elsewhere) and the CPU's
    integer dot product (engine/cpu/int8.py): faster, not exact (greedy tokens may differ).

    prefetch: while a layer computes, start reading the experts the next MoE layer's router
    would pick for the current hidden state (decode only; its hit rate is in the telemetry):
    "slots" (or True) reads them into expert slots, "hint" only asks the kernel to bring them
    into the page cache (see ExpertStore.hint), "off" (or False) does neither.

    cache_policy: which cached expert a miss evicts, "lfu" or "lru" (store.CACHE_POLICIES).

    verify_reads: check each expert block against the manifest's CRC-32 the first time it is read
    (packed folders only: direct mode has no checksums); a mismatch raises ModelLoadError.

    allow_resident_experts: load a model whose experts cannot stream (no switch-layer block)
    with them in memory, and say why in `resident_experts`; without it, such a model fails.

    experts_per_token: route each token to this many experts instead of the config's (as
    Flash-MoE runs Qwen3.5-397B with 4 of its 10); None keeps the config's.

    kv_cache "float16" keeps the KV cache in float16, as llama.cpp does (a decode step after a
    long prompt reads half the bytes; not exact): the CPU kernels only, and only where every
    layer's attention runs on them with a plain KV cache (else OptionError, naming why).
    """
    from flashmoe.engine.cpu.install import resolve

    kernels = resolve(kernels)
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    if kv_cache != "float32" and kernels not in ("cpu", "cpu-int8"):
        raise OptionError(
            f"--kv-cache {kv_cache}: the CPU kernels keep it (--kernels cpu or cpu-int8), not kernels {kernels}"
        )
    int8 = kernels == "cpu-int8"  # the CPU kernels on int8 activations (cpu/int8.py)
    if int8:
        kernels = "cpu"
    if kernels == "cpu":
        dtype = "float32"
    if dtype not in (None, "float32"):
        raise ValueError(f"dtype must be None or 'float32', got {dtype!r}")
    path = Path(path)
    config = read_config(path)
    trained_top_k = None
    if experts_per_token is not None and experts_per_token != top_k_of(config):
        trained_top_k = top_k_of(config)
        config = with_experts_per_token(config, experts_per_token, path)
    packed = _exists(path / EXPERTS_DIR / "manifest.json") or _exists(path / RESIDENT)
    where = path / EXPERTS_DIR / "manifest.json" if packed else path

    # Headers and manifest first: the config is checked against them before mlx-lm builds anything.
    if packed:
        if not _exists(path / RESIDENT):
            raise ModelLoadError(path / RESIDENT, "missing")
        layers = read_manifest(path / EXPERTS_DIR)
        resident = read_header(path / RESIDENT)
        check_against_weights(
            config,
            path / "config.json",
            {k: t.shape for k, t in resident.items()},
            {l.module: l.num_experts for l in layers},
        )
    else:
        files = _safetensors_files(path)
        headers = direct_headers(config, path, files)
    model = build_model(config, path)
    blocks = expert_blocks(model)
    _check_blocks(model, config, blocks, layers if packed else None, where, allow_resident_experts)
    if packed:
        weights = _mx_load(path / RESIDENT)
        expert_shapes = {
            f"{l.module}.{p.name}": _shape_proxy((l.num_experts, *p.shape), p.mx_dtype) for l in layers for p in l.parts
        }
    else:
        check_expert_counts(config, path, headers, blocks)
        weights = {k: v for f in files for k, v in _mx_load(f).items()}
    if hasattr(model, "sanitize"):
        # sanitize sees the experts too (some checks depend on them); stacking them stays lazy
        # and is never evaluated, because the expert tensors are dropped right after.
        weights = model.sanitize(weights)
    if not packed:  # drop exactly the tensors of the blocks that stream
        expert_shapes = {k: _shape_proxy(v.shape, v.dtype) for k, v in weights.items() if expert_tensor_of(k, blocks)}
        weights = {k: v for k, v in weights.items() if not expert_tensor_of(k, blocks)}

    try:
        quantize_like_checkpoint(
            model, config, {**{k: _shape_proxy(v.shape, v.dtype) for k, v in weights.items()}, **expert_shapes}
        )
    except (KeyError, ValueError) as e:
        raise ModelLoadError(path / "config.json", f"quantization does not match the weights ({e})") from None

    if not packed:
        layers = _direct_layers(path, blocks, headers, text_config(config).get("model_type", config["model_type"]))
    _check_layer_shapes(layers, blocks, where)
    if len(layers) != len(blocks):
        missing = sorted(set(blocks) - {l.module for l in layers})
        raise ModelLoadError(where, f"no experts for {missing[0]}")

    if prefetch == "hint" and direct_io is None:
        direct_io = False  # hints bring experts into the page cache, which only buffered reads find
    # Before any large allocation: the slots, the resident weights and the KV cache must fit in
    # what this process may use (the cgroup's limit, MemAvailable, rlimits), or it says so now.
    tensors = resident.values() if packed else [t for k, t in headers.items() if not expert_tensor_of(k, blocks)]
    # the CPU kernels tile bfloat16 scales as they are: their slots keep them so (switch._CpuExperts)
    keep_bf16 = (lambda l, blocks=blocks: _CpuExperts.keeps_bf16(blocks[l.module], l)) if kernels == "cpu" else None
    try:
        memory = memory_plan(
            config,
            layers,
            resident_bytes(tensors, dtype == "float32"),
            upcast=dtype == "float32",
            kv_cache=kv_cache,
            io_threads=io_threads,
            expert_cache=expert_cache,
            ctx_size=ctx_size,
            prompt_cache=prompt_cache,
            limit=memory_limit,
            keep_bf16=keep_bf16,
        )
    except MemoryTooSmall as e:
        raise ModelLoadError(path, str(e)) from None
    for note in memory.notes:
        log.warning("flashmoe: warning: %s", note)
    store = (
        ExpertStore(
            path / EXPERTS_DIR if packed else path,
            layers,
            top_k_of(config),
            budget_bytes=memory.expert_cache,
            io_threads=io_threads,
            direct_io=direct_io,
            upcast=dtype == "float32",
            cpu_kernels=kernels == "cpu",
            policy=cache_policy,
            verify_reads=verify_reads,
            keep_bf16=keep_bf16,
        )
        if layers
        else None
    )
    loaded = LoadedModel(model, config, path, "packed" if packed else "direct", store, layers, memory=memory)
    loaded.trained_top_k = trained_top_k
    loaded.block_kinds = {l.module: kind(blocks[l.module]) for l in layers}
    loaded.resident_experts = None if layers else no_blocks_reason(model, config)
    parents = dict(model.named_modules())
    for l in layers:
        loaded.switches[l.module] = StreamingSwitchGLU(blocks[l.module], l.layer, store, loaded.telemetry)
        _replace(model, parents, l.module, loaded.switches[l.module])
    del parents, blocks  # they name every original module; the CPU path below replaces some

    model.eval()
    if dtype == "float32":
        weights = {k: v.astype(mx.float32) if v.dtype in (mx.bfloat16, mx.float16) else v for k, v in weights.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
        mx.eval(model.parameters())
    except ValueError as e:
        raise ModelLoadError(path, f"weights do not match the config: {e}") from None
    except RuntimeError as e:
        raise ModelLoadError(path, f"cannot read the resident weights ({e})") from None
    del weights  # the model holds what it needs; the CPU path below replaces some of it
    n = declared_experts(config)
    left = resident_expert_modules(model, n) if n and n > 1 else []
    if left and not allow_resident_experts:  # experts some other code computes: never silently resident
        raise ModelLoadError(
            where,
            f"{left[0]} holds {n} experts that do not stream (not one of mlx-lm's "
            "switch layers); load with --allow-resident-experts to keep them in memory",
        )
    loaded.kernels = kernels
    prefetch = {True: "slots", False: "off", None: "off"}.get(prefetch, prefetch)
    if prefetch not in PREFETCH_MODES:
        raise ValueError(f"prefetch must be one of {PREFETCH_MODES}, got {prefetch!r}")
    if prefetch != "off" and store is not None:
        store.routers = router_weights(model, layers)
        store.prefetch_mode = prefetch
    if kernels == "cpu":
        from flashmoe.engine.cpu import fused as cpu_fused, install as cpu_path

        cpu_path.install(model)
        loaded.fused = cpu_fused.install(model)
        if kv_cache != "float32":
            cpu_fused.use_kv_cache(model, getattr(mx, kv_cache))
            loaded.kv_cache = kv_cache
        if int8:  # after the installs: their load-time probes compare float results
            from flashmoe.engine.cpu.int8 import use_int8

            loaded.int8_matrices = use_int8(model)

    if load_tokenizer:
        from flashmoe.engine.runtime.tokenizer import Tokenizer

        loaded.tokenizer = Tokenizer.from_folder(path)
    return loaded
