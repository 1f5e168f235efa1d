"""Logits processors: what reshapes the logits between the model and the sampler.

Each is a callable `(tokens, logits) -> logits`, as in mlx-lm's generate_step: `tokens` is every
id the sequence holds so far (prompt and reply), `logits` the float32 scores for the next one.
The token loop (engine/runtime/decode.py) applies them in order; the sampler then only picks.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from flashmoe.engine.options import SamplingParams
from flashmoe.engine.runtime.constrain import apply_mask

LogitsProcessor = Callable[[list, mx.array], mx.array]


def repetition_penalty(penalty: float, context: int) -> LogitsProcessor:
    """CTRL-style: make the tokens seen in the last `context` ids less likely whatever their
    logit's sign, once per id however often it was seen."""

    def process(tokens: list, logits: mx.array) -> mx.array:
        vocab = logits.shape[0]
        ids = sorted({int(i) for i in tokens[-context:] if 0 <= int(i) < vocab})
        if not ids:
            return logits
        idx = mx.array(ids)
        seen = logits[idx]
        out = mx.array(logits)  # a copy: the caller's logits stay as they were
        out[idx] = mx.where(seen > 0, seen / penalty, seen * penalty)
        return out

    return process


class ConstraintMask:
    """A Constraint (engine/runtime/constrain.py) as a logits processor: it learns the tokens chosen
    since it last ran from `tokens` itself, so the loop needs no second hook to keep it in step.
    The ids the sequence held when it first ran (the prompt) are not the constraint's."""

    def __init__(self, constraint):
        self.constraint = constraint
        self.seen: int | None = None

    def catch_up(self, tokens: list) -> None:
        if self.seen is None:
            self.seen = len(tokens)
        for t in tokens[self.seen :]:
            self.constraint.accept(int(t))
        self.seen = len(tokens)

    def __call__(self, tokens: list, logits: mx.array) -> mx.array:
        self.catch_up(tokens)
        mask = self.constraint.allowed()
        return logits if mask is None else apply_mask(logits, mask)

    def done(self, last: int) -> bool:
        """Whether the constrained text is complete with `last`, the token just chosen from this
        mask's logits, in (the next call then does not take it again)."""
        self.constraint.accept(int(last))
        self.seen += 1
        return self.constraint.done()


def processors_for(params: SamplingParams, mask: ConstraintMask | None = None) -> list[LogitsProcessor]:
    """The processors a request asks for, in the order they apply: the constraint's mask first
    (a disallowed token stays at -inf whatever else happens), then the repetition penalty."""
    out: list[LogitsProcessor] = []
    if mask is not None:
        out.append(mask)
    if params.repetition_penalty != 1.0 and params.repetition_context > 0:
        out.append(repetition_penalty(params.repetition_penalty, params.repetition_context))
    return out


def apply(processors: list[LogitsProcessor], tokens: list, logits: mx.array) -> mx.array:
    """The next token's logits (shape [vocab]) in float32, as the sampler takes them, through
    every processor."""
    logits = logits.astype(mx.float32)
    for process in processors:
        logits = process(tokens, logits)
    return logits
