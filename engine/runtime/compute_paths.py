"""Which code computes each block of a loaded model: the choice load() made, read back from the
modules themselves (engine/cpu/install.py swaps the matmuls, engine/cpu/fused.py the blocks
that pass their probe), so what `flashmoe info --load` prints is what runs."""

from __future__ import annotations

from flashmoe.engine.experts.blocks import layer_index
from flashmoe.engine.runtime.timing import decoder_layers


def compute_paths(loaded) -> dict[str, list[int]]:
    """{"attention on MLX": [0, 1], "experts on the CPU kernels": [0, 1], ...}: per kind of
    block, the decoder layers it is computed that way in."""
    fused_types: dict = {}
    cpu_linear = cpu_attention = None
    whole_step = False
    if loaded.kernels == "cpu":
        from flashmoe.engine.cpu.decode_step import CpuModelStep
        from flashmoe.engine.cpu.fused import CpuAttention, CpuDecoderLayer, CpuMLP, CpuMoE
        from flashmoe.engine.cpu.install import CpuQuantizedLinear

        fused_types = {CpuDecoderLayer: "decoder layer", CpuAttention: "attention", CpuMLP: "MLP", CpuMoE: "MoE"}
        whole_step = any(isinstance(m, CpuModelStep) for _, m in loaded.model.named_modules())
        cpu_linear, cpu_attention = CpuQuantizedLinear, CpuAttention
    out: dict[str, list[int]] = {}

    def say(what: str, i: int) -> None:
        layers = out.setdefault(what, [])
        if not layers or layers[-1] != i:
            layers.append(i)

    int8, activations = None, ""
    if getattr(loaded, "int8_matrices", 0):  # (a bank switched to int8 counts too)
        from flashmoe.engine.cpu.int8 import dot_name, many_rows, x_name

        activations = x_name()
        int8 = (
            f"resident matmuls on {activations} ({dot_name()} dot products, approximate"
            + ("" if many_rows() else "; prompt chunks on the float kernels")
            + ")"
        )
    by_layer: dict[int, list] = {}
    for path, switch in loaded.switches.items():  # the fused blocks hold them out of the module tree
        by_layer.setdefault(layer_index(path), []).append(switch)
    for i, layer in enumerate(decoder_layers(loaded.model)):
        modules = [layer] + [m for _, m in layer.named_modules()]
        fused = {fused_types[type(m)] for m in modules if type(m) in fused_types}
        if whole_step:
            say("one-token steps on numpy from embedding to final norm (one sync per token)", i)
        for kind in ("decoder layer", "attention", "MLP", "MoE"):
            if kind in fused:
                say(
                    f"{kind} as one fused CPU block"
                    if kind != "decoder layer"
                    else "decoder layer fused whole (one sync per layer)",
                    i,
                )
        one_call = layer.one_call() if "decoder layer" in fused else None
        if one_call:
            say(
                "decode steps one kernel call a layer" + (" while its experts are cached" if one_call == "moe" else ""),
                i,
            )
        if cpu_attention is not None and any(isinstance(m, cpu_attention) and m.prefill_ok for m in modules):
            say("prompt chunks' attention on numpy's BLAS", i)
        if "attention" not in fused:
            linear = [m for m in modules if cpu_linear is not None and isinstance(m, cpu_linear)]
            say("attention and other matmuls on the CPU kernels" if linear else "attention and other matmuls on MLX", i)
        if int8 and any(getattr(getattr(m, "tiled", None), "int8", False) for m in modules):
            say(int8, i)
        switches = by_layer.get(i, [])
        if switches:
            if not all(s.on_cpu_kernels for s in switches):
                say("streamed experts on MLX", i)
            elif all(s.tiled_bank is not None for s in switches):
                bank_int8 = all(s.tiled_bank.int8 for s in switches)
                say(
                    "streamed experts on the CPU kernels, repacked into tiles as they land"
                    + (f", on {activations} (approximate)" if bank_int8 else ""),
                    i,
                )
            else:
                say("streamed experts on the CPU kernels (in the layout read)", i)
    return out
