"""Per-layer timing.

MLX is lazy, so a phase's time is only known if we force evaluation at its end. In `step` mode we
add no sync of our own: the expert store still reports what it sees on the host (the router sync,
read waits, hits, bytes). In `layer` mode, wrappers around each decoder layer and its attention
evaluate their outputs, which splits the layer into attention / routing / I/O / compute / other
at the price of a few extra syncs per layer.
"""

from __future__ import annotations

from time import perf_counter

import mlx.core as mx
import mlx.nn as nn

from flashmoe.engine.events import LayerRow

MIXER_NAMES = ("self_attn", "linear_attn", "attention", "attn", "mixer")


class _Timed(nn.Module):
    """Runs `inner`; in layer mode evaluates its output and adds the time to `sink[index]`."""

    def __init__(self, inner: nn.Module, sink: dict, index: int, telemetry):
        super().__init__()
        self.inner = inner
        self._sink, self._index, self._telemetry = sink, index, telemetry

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "inner" not in self:
                raise
            return getattr(self["inner"], name)

    def __call__(self, *args, **kwargs):
        if self._telemetry.mode != "layer":
            return self.inner(*args, **kwargs)
        t0 = perf_counter()
        out = self.inner(*args, **kwargs)
        mx.eval(out)
        self._sink[self._index] = self._sink.get(self._index, 0.0) + perf_counter() - t0
        return out


def decoder_layers(model: nn.Module) -> list:
    """The list object the model iterates (its `layers` property may return a copy)."""
    n = len(model.layers)
    for _, m in model.named_modules():
        if isinstance(m.get("layers"), list) and len(m["layers"]) == n:
            return m["layers"]
    raise ValueError("cannot find the decoder layers of this model")


class LayerClock:
    """Installs the layer-mode wrappers once and turns the counters into LayerRows."""

    def __init__(self, loaded):
        self.loaded = loaded
        self.attn: dict[int, float] = {}
        self.total: dict[int, float] = {}
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        telemetry = self.loaded.telemetry
        layers = decoder_layers(self.loaded.model)
        for i, layer in enumerate(layers):
            for name in MIXER_NAMES:
                if name in layer and isinstance(layer[name], nn.Module):
                    layer[name] = _Timed(layer[name], self.attn, i, telemetry)
                    break
            layers[i] = _Timed(layer, self.total, i, telemetry)
        self._installed = True

    def rows(self, store_stats: dict) -> tuple[LayerRow, ...]:
        out = rows_from(self.loaded.num_layers, store_stats, self.attn, self.total)
        self.reset()
        return out

    def reset(self) -> None:
        self.attn.clear()
        self.total.clear()


def rows_from(
    num_layers: int, store_stats: dict, attn: dict | None = None, total: dict | None = None
) -> tuple[LayerRow, ...]:
    """One row per layer; without layer timing only the store's host-side figures are known."""
    attn, total = attn or {}, total or {}
    rows = []
    for i in range(num_layers):
        s = store_stats.get(i)
        a = attn.get(i, 0.0)
        route, io, compute = (s.route_s, s.io_wait_s, s.compute_s) if s else (0.0, 0.0, 0.0)
        other = max(0.0, total[i] - a - route - io - compute) if i in total else 0.0
        rows.append(
            LayerRow(
                i,
                a * 1e3,
                route * 1e3,
                io * 1e3,
                compute * 1e3,
                other * 1e3,
                s.hits if s else 0,
                s.misses if s else 0,
                s.bytes_read if s else 0,
            )
        )
    return tuple(rows)
