"""A MoE decoder layer's decode step as one kernel call (fused.CpuDecoderLayer), for the upcycled
demo's 30 layers about 1.1 ms of a 15-17 ms step: the Python between the attention block, the
router, the routing and the experts' call cost about 48 us a layer.

It chains kernels that exist already, each of its own kernel set: the attention block
(`_attn_half`) and the experts (`_swiglu_sum`) of the layer's format, and the router's `_run` of
its own (mlx-lm quantizes routers to 8 bits where the rest may be 4). So it is compiled per triple
of kernels, its name tagged with theirs (numba caches a function by its qualified name)."""
from __future__ import annotations

import re

import numpy as np
from numba import njit

from flashmoe.engine.cpu import numba_cache  # noqa: F401 - before any kernel is defined (see there)
from flashmoe.engine.cpu.clock import monotonic
from flashmoe.engine.cpu.routing import route_slots

TEMPLATE = """
@njit(cache=True, nogil=True)
def _moe_layer(x, w1, eps1, wq, sq, bq, bias_q, q0, k0, v0, H, Hk, hd, qn, qeps, q_per_head, kn, keps, k_per_head,
               a, b, partner, K, V, pos, scale, wo, so, bo, bias_o, w2, eps2, par_q, par_o,
               wr, sr, br, bias_r, E, k, mode, slot_of, layer, layer_of, expert_of, raw,
               wa, sa, ba, wb, sb, bb, wd, sd, bd, par_e, ids, scores, slots, times):
    # x [1, D]: the attention block (h, n2 = norm2(h)); the router on n2 (+ bias_r: [E] or [0])
    # and route_slots into ids, scores, slots; then, where each expert chosen is in the slot
    # slot_of says, the experts and the residual. Returns (h + experts(n2), n2, True), or
    # (h, n2, False) with the routing done and the experts left to the caller. times[0..2]: the
    # seconds of the attention block, the routing, the experts.
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
    y = swiglu_sum(wa, sa, ba, wb, sb, bb, wd, sd, bd, n2, slots, scores[0], np.empty((0, n2.shape[1]), np.float32),
                   par_e)
    for d in range(h.shape[1]):
        h[0, d] += y[0, d]
    times[2] = monotonic() - t2
    return h, n2, True
"""

_compiled: dict = {}


def kernel(attn_half, swiglu_sum, router_run):
    """`_moe_layer` over these three kernels (numba dispatchers), compiled once per triple."""
    key = tuple(f.__name__ for f in (attn_half, swiglu_sum, router_run))
    if key not in _compiled:
        tag = re.sub(r"\W", "_", "__".join(key))
        ns = dict(__name__=__name__, np=np, njit=njit, monotonic=monotonic, route_slots=route_slots, attn_half=attn_half,
                  swiglu_sum=swiglu_sum, router_run=router_run)
        exec(compile(TEMPLATE.replace("def _moe_layer(", f"def _moe_layer{tag}("), __file__, "exec"), ns)  # noqa: S102
        _compiled[key] = ns[f"_moe_layer{tag}"]
    return _compiled[key]
