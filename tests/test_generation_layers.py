"""Generation in layers: the token loop (decode.py) yields ids and runs no forward pass the
consumer did not ask for; logits processors (processors.py) carry the constraint mask and the
repetition penalty; the event layer (generate.py) gives the same ids as the loop under it."""

from __future__ import annotations

import inspect
import threading

import mlx.core as mx
import numpy as np

from flashmoe.engine import TokenGenerated
from flashmoe.engine.runtime.decode import decode, prefill
from flashmoe.engine.runtime.engine import Engine
from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate, render_prompt
from flashmoe.engine.runtime.loader import load
from flashmoe.engine.runtime.processors import ConstraintMask, apply, processors_for, repetition_penalty
from flashmoe.engine.runtime.sampling import Sampler, SamplingParams
from tests.helpers.streaming import greedy
from tests.tiny_models import reference_model

CHAT = [{"role": "user", "content": "Name three rivers."}]


def test_load_and_engine_default_to_the_same_kernels():
    def default(fn):
        return inspect.signature(fn).parameters["kernels"].default

    assert default(load) == default(Engine.__init__)


def test_token_loop_yields_the_reference_ids_and_runs_only_the_passes_asked_for(model_factory):
    src = model_factory("qwen3_moe", 4)
    lm = load(model_factory("qwen3_moe", 4, converted=True))
    ids = render_prompt(lm, GenerationRequest(messages=CHAT))
    session = Session(lm)
    session.prepare(ids)
    progress = [done for done, _ in prefill(lm.model, session, ids, 3, threading.Event())]
    assert progress == list(range(3, len(ids), 3)) + [len(ids)] and session.tokens == ids
    session = Session(lm)
    session.prepare(ids)
    for _, logits in prefill(lm.model, session, ids, 256, threading.Event()):  # noqa: B007 (the last logits are used below)
        pass
    loop = decode(lm.model, session, logits, Sampler(SamplingParams()), [])
    got = [next(loop) for _ in range(6)]
    assert got == greedy(reference_model(src), ids, 6)
    # six tokens taken: five forward passes ran, the last token is not in the cache yet
    assert session.tokens == ids + got[:5]
    assert session.cache[0].offset == len(ids) + 5


def test_event_layer_gives_the_token_loops_ids(model_factory):
    lm = load(model_factory("qwen3_moe", 4, converted=True))
    request = GenerationRequest(
        messages=CHAT, max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3)
    )
    events = [e.id for e in generate(lm, Session(lm), request) if isinstance(e, TokenGenerated)]
    ids = render_prompt(lm, request)
    session = Session(lm)
    session.prepare(ids)
    for _, logits in prefill(lm.model, session, ids, request.prefill_step, threading.Event()):  # noqa: B007 (the last logits are used below)
        pass
    loop = decode(lm.model, session, logits, Sampler(request.sampling), processors_for(request.sampling))
    assert events == [next(loop) for _ in range(len(events))]


class OnlyAfter:
    """A constraint that allows only token `a`, then only `b`, then is done."""

    def __init__(self, a: int, b: int, vocab: int):
        self.order, self.vocab, self.seen = [a, b], vocab, []

    def allowed(self):
        mask = np.zeros(self.vocab, dtype=bool)
        mask[self.order[min(len(self.seen), 1)]] = True
        return mask

    def accept(self, token: int) -> None:
        self.seen.append(token)

    def done(self) -> bool:
        return len(self.seen) >= 2


def test_constraint_mask_learns_chosen_tokens_from_the_sequence():
    c = OnlyAfter(2, 0, 4)
    mask = ConstraintMask(c)
    logits = mx.array([5.0, 1.0, 0.0, 3.0])
    prompt = [3, 3, 1]
    assert int(mx.argmax(mask(prompt, logits)).item()) == 2 and c.seen == []  # the prompt is not the constraint's
    assert int(mx.argmax(mask(prompt + [2], logits)).item()) == 0 and c.seen == [2]
    assert mask.done(0) and c.seen == [2, 0]
    mask(prompt + [2, 0], logits)  # the token done() took is not taken again
    assert c.seen == [2, 0]


def test_processors_apply_in_order_and_leave_the_callers_logits():
    logits = mx.array([1.0, 3.0, 2.5, 0.5], dtype=mx.bfloat16)
    out = apply([repetition_penalty(2.0, 8)], [1], logits)
    assert out.dtype == mx.float32 and out.tolist() == [1.0, 1.5, 2.5, 0.5]
    assert logits.tolist() == [1.0, 3.0, 2.5, 0.5]
    assert processors_for(SamplingParams()) == []  # nothing asked, nothing run
    mask = ConstraintMask(OnlyAfter(1, 0, 4))
    both = processors_for(SamplingParams(repetition_penalty=2.0), mask)
    assert both[0] is mask and len(both) == 2
    # the mask first: the penalised token is still the only one allowed
    assert int(mx.argmax(apply(both, [1], logits)).item()) == 1
