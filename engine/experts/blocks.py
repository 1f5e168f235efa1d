"""Which modules of an mlx-lm model hold routed experts, recognised by what they are.

Every MoE architecture mlx-lm implements computes its routed experts in one of the two switch
layers of mlx_lm/models/switch_layers.py: SwitchGLU (gated: gate/up/down) or SwitchMLP (fc1/fc2).
Their attribute name varies (`switch_mlp`, `experts`, `experts.switch_glu`, ...), so a block is
found by its class, never by its name. Each block's parameters are stacked [E, ...] over experts:
that is what the store streams.
"""

from __future__ import annotations

import re

import mlx.nn as nn
from mlx.utils import tree_flatten

from flashmoe.engine.runtime.config_check import EXPERT_COUNT_KEYS


# Layer containers as mlx-lm names them: model.layers.N, transformer.h.N (phixtral), blocks.N.
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")


def switch_classes() -> tuple[type, ...]:
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return SwitchGLU, SwitchMLP


def expert_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Every routed-expert block (a SwitchGLU or SwitchMLP) by module path, in layer order."""
    classes = switch_classes()
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, classes)]
    return dict(sorted(found, key=lambda nm: (_layer_or_none(nm[0]) or 0, nm[0])))


def _layer_or_none(path: str) -> int | None:
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def layer_index(module_path: str) -> int:
    """The decoder layer a block belongs to: model.layers.3.mlp.switch_mlp -> 3."""
    m = _LAYER.search(module_path)
    if not m:
        raise ValueError(f"cannot tell the layer of {module_path}")
    return int(m.group(1))


def block_of(name: str, blocks) -> str | None:
    """The block path a parameter name lies under, if any."""
    return next((b for b in blocks if name.startswith(b + ".")), None)


def expert_children(block: nn.Module) -> list[str]:
    """The block's stacked projections (SwitchLinear / QuantizedSwitchLinear children): what
    streams. Anything else a model hangs on the block (muse_spark's post_expert_norm) stays
    resident."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    return [n for n, c in block.children().items() if isinstance(c, (SwitchLinear, QuantizedSwitchLinear))]


def expert_params(block: nn.Module) -> list[tuple[str, object]]:
    """(name inside the block, array) of every streamed tensor: gate_proj.weight, fc1.scales, ..."""
    return [(f"{c}.{k}", v) for c in expert_children(block) for k, v in tree_flatten(getattr(block, c).parameters())]


def expert_tensor_of(name: str, blocks: dict) -> str | None:
    """The block whose streamed tensors include `name` (a full parameter name), if any."""
    b = block_of(name, blocks)
    if b is None:
        return None
    return b if name[len(b) + 1 :].split(".")[0] in expert_children(blocks[b]) else None


def kind(module: nn.Module) -> str:
    """How a block computes, for `flashmoe info`: 'SwitchGLU (SwiGLU)', 'SwitchMLP (ReLU2)'."""
    act = getattr(module, "activation", None)
    act_name = type(act).__name__ if isinstance(act, nn.Module) else getattr(act, "__name__", repr(act))
    return f"{type(module).__name__} ({act_name})"


def declared_experts(config: dict) -> int | None:
    """How many routed experts per MoE layer the config says the model has (None: no MoE keys)."""
    c = {**config, **(config.get("text_config") or {})}
    for key in EXPERT_COUNT_KEYS:
        v = c.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def resident_expert_modules(model: nn.Module, num_experts: int) -> list[str]:
    """Modules outside any switch block that compute experts some other way, and would stay
    resident: their own weights are stacked over the experts ([E, out, in]) and a router
    (a linear layer with E outputs) sits in them or beside them. Stacks without a router (an
    attention's per-head MultiLinear) are not experts."""
    blocks = expert_blocks(model)
    modules = dict(model.named_modules())
    out = []
    for name, m in modules.items():
        if name in blocks or block_of(name, blocks):
            continue
        own = [p for k, p in tree_flatten(m.parameters()) if "." not in k]  # m's own, not its children's
        if any(p.ndim == 3 and p.shape[0] == num_experts for p in own) and (
            _has_router(m, num_experts) or _has_router(modules.get(name.rpartition(".")[0]), num_experts)
        ):
            out.append(f"{name} ({type(m).__name__})")
    return out


def _has_router(m, num_experts: int) -> bool:
    return isinstance(m, nn.Module) and any(
        isinstance(c, (nn.Linear, nn.QuantizedLinear)) and c.weight.shape[0] == num_experts
        for c in m.children().values()
        if isinstance(c, nn.Module)
    )


def no_blocks_reason(model: nn.Module, config: dict) -> str | None:
    """Why a model that declares experts has no block the store could take over (None: it has
    blocks, or declares no experts)."""
    n = declared_experts(config)
    if not n or n < 2 or expert_blocks(model):
        return None
    others = resident_expert_modules(model, n)
    mtype = config.get("model_type")
    if others:
        return (
            f"{mtype}: its config declares {n} experts, but they are computed by {others[0]}, "
            "not by one of mlx-lm's switch layers (SwitchGLU, SwitchMLP), so they cannot stream"
        )
    return (
        f"{mtype}: its config declares {n} experts, but the model mlx-lm builds has no "
        "switch-layer expert block (SwitchGLU, SwitchMLP) to stream"
    )


def cpu_kernels_reason(module: nn.Module, quantized: bool) -> str | None:
    """Why the numba CPU kernels cannot compute this block (None: they can). They run SwiGLU
    experts (gate/up/down, affine quantized, no biases); anything else runs on MLX's own path."""
    from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

    if not isinstance(module, SwitchGLU):
        return f"non-gated {type(module).__name__}"
    act = getattr(module, "activation", None)
    if type(act) is not SwiGLU:
        return f"activation {type(act).__name__}"
    if any("bias" in getattr(module, p) for p in ("gate_proj", "up_proj", "down_proj")):
        return "expert biases"
    if not quantized:
        return "float experts"
    return None
