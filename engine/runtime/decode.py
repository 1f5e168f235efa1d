"""The token loop: the model run over a prompt, then one token at a time. Ids in, ids out.

Like mlx-lm's generate_step it knows nothing of text, stop strings or timing (generate.py adds
those on top). Both layers are plain generators: a consumer that stops iterating has run no
forward pass past the last token it took, so the session's cache holds exactly the sequence.
"""

from __future__ import annotations

import threading
from typing import Iterator

import mlx.core as mx

from flashmoe.engine.runtime.processors import LogitsProcessor, apply


def prefill(model, session, ids: list[int], step: int, cancel: threading.Event) -> Iterator[tuple[int, mx.array]]:
    """Run `ids` into the session's cache `step` tokens at a time; after each chunk yield how many
    are done and the logits after the chunk's last token. Stops early (between chunks) on cancel.
    On the CPU kernels the output head computes only those logits (cpu/install.py)."""
    from flashmoe.engine.cpu.install import last_logits_only

    done = 0
    while done < len(ids) and not cancel.is_set():
        chunk = ids[done : done + step]
        with last_logits_only():
            logits = model(mx.array([chunk]), cache=session.cache)[0, -1]
        mx.eval(logits, [c.state for c in session.cache if c.state is not None])
        session.tokens.extend(chunk)
        done += len(chunk)
        yield done, logits


def decode(model, session, logits: mx.array, sampler, processors: list[LogitsProcessor]) -> Iterator[int]:
    """Yield the token chosen from `logits`, then (when asked for the next) run the model on it
    and yield the token after it, for ever. The sequence the processors see is the session's
    tokens and the chosen ones."""
    tokens = list(session.tokens)
    while True:
        token = sampler(apply(processors, tokens, logits))
        yield token
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=session.cache)[0, -1]
        mx.eval(logits)
        session.tokens.append(token)
