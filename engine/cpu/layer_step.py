"""A decoder layer's decode step as one kernel call (fused.CpuDecoderLayer): the Python between
the attention block, the router, the routing and the experts' call cost the upcycled demo about
48 us a layer (1.1 ms of a 15-17 ms step); between the attention block and a dense MLP's two
matmuls, SmolLM2 4-bit about 23 us a layer (0.7 ms of a 10-11 ms step).

Each chains kernels that exist already, each of its own kernel set: the attention block
(`_attn_half`), the experts (`_swiglu_sum`) and the matmuls (`_run`) of their formats (mlx-lm
quantizes MoE routers to 8 bits where the rest may be 4). So each is compiled per tuple of
kernels, its name tagged with theirs (numba caches a function by its qualified name)."""

from __future__ import annotations

import re

import numpy as np
from numba import njit

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)
from flashmoe.engine.cpu.attn import silu_mul
from flashmoe.engine.cpu.clock import monotonic
from flashmoe.engine.cpu.routing import gate_rows, route_slots

MOE = """
@njit(cache=True, nogil=True)
def _moe_layer(x, w1, eps1, wq, sq, bq, bias_q, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps, k_per_head,
               a, b, partner, K, V, pos, scale, wo, so, bo, bias_o, w2, eps2, par_q, par_o,
               wr, sr, br, bias_r, E, k, mode, slot_of, layer, layer_of, expert_of, raw,
               wa, sa, ba, wb, sb, bb, wd, sd, bd, par_e, SHARED_ARGS ids, scores, slots, times):
    # x [1, D]: the attention block (h, n2 = norm2(h)); the router on n2 (+ bias_r: [E] or [0])
    # and route_slots into ids, scores, slots; then, where each expert chosen is in the slot
    # slot_of says, the experts (plus a shared expert where it has one) and the residual. Returns
    # (h + experts(n2), n2, True), or (h, n2, False) with the routing done and the experts left
    # to the caller. times[0..2]: the seconds of the attention block, the routing, the experts.
    t0 = monotonic()
    h, n2 = attn_half(x, w1, eps1, wq, sq, bq, bias_q, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps,
                      k_per_head, a, b, partner, K, V, pos, scale, wo, so, bo, bias_o, w2, eps2, par_q, par_o)
    t1 = monotonic()
    logits = router_run(wr, sr, br, n2, False)[:, :E]
    if bias_r.shape[0]:
        logits = logits + bias_r
    hit = route_slots(logits, k, mode, slot_of, layer, layer_of, expert_of, raw, ids, scores, slots)
    t2 = monotonic()
    times[0] = t1 - t0
    times[1] = t2 - t1
    if not hit:
        return h, n2, False
    shared = SHARED_CODE
    y = swiglu_sum(wa, sa, ba, wb, sb, bb, wd, sd, bd, n2, slots, scores[0], shared, par_e)
    for d in range(h.shape[1]):
        h[0, d] += y[0, d]
    times[2] = monotonic() - t2
    return h, n2, True
"""

# MOE's shared expert: none, or Qwen2-MoE's (`shared(...)`, below), computed with the experts, in
# their seconds, and handed to them as the separate calls hand it
NO_SHARED = dict(SHARED_ARGS="", SHARED_CODE="np.empty((0, n2.shape[1]), np.float32)")
WITH_SHARED = dict(
    SHARED_ARGS="wgu, sgu, bgu, u0, n, par_gu, wsd, ssd, bsd, par_sd, wg, sg, bg, gated,",
    SHARED_CODE="shared(n2, wgu, sgu, bgu, u0, n, par_gu, wsd, ssd, bsd, par_sd, wg, sg, bg, gated)",
)
SHARED = """
@njit(cache=True, nogil=True)
def shared(n2, wgu, sgu, bgu, u0, n, par_gu, wsd, ssd, bsd, par_sd, wg, sg, bg, gated):
    # down(silu(gate(n2)) * up(n2)), gate and up stacked (up from column u0, n wide each), times
    # sigmoid(its gate(n2)) where `gated` (shared_expert_gate; wg, sg, bg its tiles): [1, D]
    gu = shared_gate_up_run(wgu, sgu, bgu, n2, par_gu)
    out = np.ascontiguousarray(shared_down_run(wsd, ssd, bsd, silu_mul(gu[:, :n], gu[:, u0:u0 + n]), par_sd)[:, :n2.shape[1]])
    if gated:
        gate_rows(out, np.ascontiguousarray(shared_gate_run(wg, sg, bg, n2, False)[:, :1]))
    return out
"""

MLP = """
@njit(cache=True, nogil=True)
def _mlp_layer(x, w1, eps1, wq, sq, bq, bias_q, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps, k_per_head,
               a, b, partner, K, V, pos, scale, wo, so, bo, bias_o, w2, eps2, par_q, par_o,
               wgu, sgu, bgu, u0, n, par_gu, wd, sd, bd, par_d):
    # x [1, D]: the attention block (h, n2 = norm2(h)), then h + down(silu(gate(n2)) * up(n2)),
    # gate and up stacked in one matrix (up from column u0, n wide each)
    h, n2 = attn_half(x, w1, eps1, wq, sq, bq, bias_q, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps,
                      k_per_head, a, b, partner, K, V, pos, scale, wo, so, bo, bias_o, w2, eps2, par_q, par_o)
    gu = gate_up_run(wgu, sgu, bgu, n2, par_gu)
    y = down_run(wd, sd, bd, silu_mul(gu[:, :n], gu[:, u0:u0 + n]), par_d)
    for d in range(h.shape[1]):
        h[0, d] += y[0, d]
    return h
"""

_compiled: dict = {}


def _instantiate(template: str, name: str, kernels: dict):
    """`name` of `template` over `kernels` (name in the template -> numba dispatcher), compiled
    once per set; every function the template defines is tagged with the kernels' names."""
    key = (name, *(f.__name__ for f in kernels.values()))
    if key not in _compiled:
        tag = re.sub(r"\W", "_", "__".join(key[1:]))
        ns = dict(
            __name__=__name__,
            np=np,
            njit=njit,
            monotonic=monotonic,
            route_slots=route_slots,
            gate_rows=gate_rows,
            silu_mul=silu_mul,
            **kernels,
        )
        for defined in re.findall(r"^def (\w+)\(", template, flags=re.M):
            template = re.sub(rf"\b{defined}\(", f"{defined}{tag}(", template)
        exec(compile(template, __file__, "exec"), ns)  # noqa: S102 - our own template
        _compiled[key] = ns[f"{name}{tag}"]
    return _compiled[key]


def _moe(fill: dict) -> str:
    """MOE with its SHARED_ARGS and SHARED_CODE filled in."""
    return MOE.replace("SHARED_ARGS", fill["SHARED_ARGS"]).replace("SHARED_CODE", fill["SHARED_CODE"])


def moe_kernel(attn_half, swiglu_sum, router_run):
    """A MoE layer's step (MOE, no shared expert) over these kernels."""
    return _instantiate(
        _moe(NO_SHARED), "_moe_layer", dict(attn_half=attn_half, swiglu_sum=swiglu_sum, router_run=router_run)
    )


def shared_moe_kernel(attn_half, swiglu_sum, router_run, shared_gate_up_run, shared_down_run, shared_gate_run):
    """A MoE layer's step with a shared expert (MOE with SHARED) over these kernels."""
    return _instantiate(
        SHARED + _moe(WITH_SHARED),
        "_moe_layer",
        dict(
            attn_half=attn_half,
            swiglu_sum=swiglu_sum,
            router_run=router_run,
            shared_gate_up_run=shared_gate_up_run,
            shared_down_run=shared_down_run,
            shared_gate_run=shared_gate_run,
        ),
    )


def mlp_kernel(attn_half, gate_up_run, down_run):
    """A dense layer's step (MLP) over these kernels."""
    return _instantiate(MLP, "_mlp_layer", dict(attn_half=attn_half, gate_up_run=gate_up_run, down_run=down_run))
