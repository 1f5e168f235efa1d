"""Constrained decoding: the hook the generation loop calls around each sampled token.

A Constraint says which tokens may come next (a boolean mask over the vocabulary, or None when
it does not restrict this step), is told which token was chosen, and says when the text it
constrains is complete. Requests carry a factory, `make(tokenizer) -> Constraint`, so that the
stateful object is built on the engine thread for each generation.
"""

from __future__ import annotations

from typing import Callable, Protocol

import mlx.core as mx
import numpy as np


class Constraint(Protocol):
    def allowed(self) -> np.ndarray | None:
        """Boolean mask over token ids for the next token, or None for no restriction."""

    def accept(self, token: int) -> None:
        """The token that was sampled."""

    def done(self) -> bool:
        """True when the constrained text is complete and generation should stop."""


ConstraintFactory = Callable[[object], Constraint]


def apply_mask(logits: mx.array, mask: np.ndarray) -> mx.array:
    """Logits of disallowed tokens to -inf. The model's vocabulary may be padded past the
    tokenizer's: padding ids are never allowed."""
    n = logits.shape[-1]
    full = np.zeros(n, dtype=bool)
    m = min(n, mask.shape[0])
    full[:m] = mask[:m]
    if not full.any():
        raise RuntimeError("the constraint allows no token at all")
    return mx.where(mx.array(full), logits, mx.array(-np.inf, dtype=logits.dtype))
