"""The streamed engine gives the resident mlx-lm model's logits and greedy tokens, exactly.

Per architecture and precision; with every expert cached, with a cache of only what one token
needs (`--expert-cache 0`), with a budget smaller than one layer's experts (either eviction
policy), and in direct mode.
"""

from __future__ import annotations

import os
from collections import Counter

import mlx.core as mx
import pytest

from flashmoe.engine.runtime.loader import load
from tests.helpers.streaming import CASES, PROMPT, greedy, small_budget
from tests.tiny_models import reference_model


@pytest.mark.parametrize("arch,bits", CASES, ids=[f"{a}-{b or 'f32'}" for a, b in CASES])
def test_streamed_equals_resident(model_factory, arch, bits):
    src = model_factory(arch, bits)
    packed = model_factory(arch, bits, converted=True)
    ref = reference_model(src)
    tokens = mx.array([PROMPT])
    ref_logits = ref(tokens)
    ref_greedy = greedy(ref, PROMPT, 32)
    assert len(set(ref_greedy)) > 3, "degenerate reference: the test would prove little"

    probe = load(packed, load_tokenizer=False)
    variants = {
        "packed, all cached": (packed, None, "lfu"),
        "packed, cache 0": (packed, 0, "lfu"),
        "packed, budget < one layer": (packed, small_budget(probe), "lfu"),
        "packed, budget < one layer, lru": (packed, small_budget(probe), "lru"),
        "direct": (src, None, "lfu"),
        "direct, cache 0": (src, 0, "lfu"),
    }
    for name, (path, budget, policy) in variants.items():
        lm = load(path, expert_cache=budget, load_tokenizer=False, cache_policy=policy)
        assert lm.mode == ("packed" if path == packed else "direct")
        diff = mx.abs(lm.model(tokens) - ref_logits).max().item()
        assert diff <= 1e-5, f"{name}: max |logit difference| {diff}"
        assert greedy(lm.model, PROMPT, 32) == ref_greedy, name
        if budget is not None:
            assert lm.store.capacity_bytes <= max(budget, lm.top_k * lm.layers[0].expert_bytes)
        lm.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bfloat16_scales_stream_as_the_resident_model_computes(tmp_path, arch):
    """An mlx-lm folder whose quantization scales and biases are bfloat16, as mlx-community's are.
    Loaded in float32 (the CPU default), every expert's scales are widened on read (MLX kernels)
    or kept as they are (the CPU kernels' tiles), and the weights beside them must land too: the
    resident mlx-lm model, its floats widened the same way, is the reference. (The staged read
    once widened the scales and dropped the weights of the same read, on both sides of the older
    comparison, so that test agreed with itself.)"""
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.utils import save_model

    from tests.tiny_models import save_folder

    src = save_folder(tmp_path / "f32", arch, bits=4)
    model = reference_model(src)
    model.update(tree_map(lambda p: p.astype(mx.bfloat16) if p.dtype == mx.float32 else p, model.parameters()))
    save_model(tmp_path / "f32", model)  # same folder and config, every float in bfloat16
    assert all(p.dtype == mx.bfloat16 for n, p in tree_flatten(model.parameters()) if n.endswith("scales"))
    ref = reference_model(src)
    ref.update(tree_map(lambda p: p.astype(mx.float32) if p.dtype == mx.bfloat16 else p, ref.parameters()))
    want = greedy(ref, PROMPT, 16)
    assert len(set(want)) > 3
    from flashmoe.engine.formats.convert import convert

    packed = convert(src, tmp_path / "fm")
    for path in (src, packed):
        for kernels in ("mlx", "cpu"):
            lm = load(path, load_tokenizer=False, dtype="float32", kernels=kernels)
            diff = mx.abs(lm.model(mx.array([PROMPT])) - ref(mx.array([PROMPT]))).max().item()
            assert diff <= (1e-5 if kernels == "mlx" else 1e-3), (path.name, kernels, diff)
            assert greedy(lm.model, PROMPT, 16) == want, (path.name, kernels)
            lm.close()


def test_small_budget_really_streams(model_factory):
    """With a budget below one layer's experts, decoding must miss and evict, not cache all."""
    packed = model_factory("qwen3_moe", 4, converted=True)
    probe = load(packed, load_tokenizer=False)
    lm = load(packed, expert_cache=small_budget(probe), load_tokenizer=False)
    greedy(lm.model, PROMPT, 16)
    stats = lm.store.take_stats()
    assert sum(s.misses for s in stats.values()) > 0
    assert lm.store.pools[0].slots == lm.top_k + 1


@pytest.mark.parametrize("path_kind", ["packed", "direct"])
def test_o_direct_reads_give_the_same_logits(model_factory, path_kind):
    packed = model_factory("mixtral", 4, converted=True)
    src = model_factory("mixtral", 4)
    path = packed if path_kind == "packed" else src  # direct mode: unaligned offsets
    ref = reference_model(src)(mx.array([PROMPT]))
    lm = load(path, expert_cache=0, direct_io=True, load_tokenizer=False)
    assert mx.abs(lm.model(mx.array([PROMPT])) - ref).max().item() <= 1e-5
    assert sum(s.bytes_read for s in lm.store.take_stats().values()) > 0
    lm.close()


@pytest.mark.parametrize("direct_io", [None, False])
def test_reads_are_o_direct_by_default_and_buffered_where_the_file_system_refuses(
    model_factory, monkeypatch, direct_io
):
    """The default (None) opens the expert files with O_DIRECT; where a file system says EINVAL
    to it, the file is read through the page cache instead, with the same logits. --buffered-io
    (False) never asks; --direct-io (True) that cannot is one error naming the file."""
    import errno

    from flashmoe.engine.errors import ModelLoadError

    packed = model_factory("mixtral", 4, converted=True)
    ref = reference_model(model_factory("mixtral", 4))(mx.array([PROMPT]))
    lm = load(packed, expert_cache=0, direct_io=direct_io, load_tokenizer=False)
    lm.model(mx.array([PROMPT]))
    assert bool(lm.store._direct_fds) == (direct_io is None)
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    lm = load(packed, expert_cache=0, direct_io=direct_io, load_tokenizer=False)
    assert mx.abs(lm.model(mx.array([PROMPT])) - ref).max().item() <= 1e-5
    assert not lm.store._direct_fds and lm.store._fds
    with pytest.raises(ModelLoadError, match="cannot open with O_DIRECT: Invalid argument"):
        load(packed, expert_cache=0, direct_io=True, load_tokenizer=False).model(mx.array([PROMPT]))


def _open_fds() -> list[str]:
    return [
        os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd") if os.path.exists(f"/proc/self/fd/{f}")
    ]


@pytest.mark.parametrize("path_kind", ["packed", "direct"])
def test_reader_threads_open_each_file_once_and_close_frees_them(model_factory, path_kind):
    """Reader threads open expert files lazily; racing opens of one file leaked a descriptor
    each (a server or a long suite ran out of them). Closing must give back every one."""
    packed = model_factory("qwen3_moe", 4, converted=True)
    path = packed if path_kind == "packed" else model_factory("qwen3_moe", 4)
    before = Counter(_open_fds())
    lm = load(path, expert_cache=0, load_tokenizer=False)
    greedy(lm.model, PROMPT, 8)
    opened = Counter(_open_fds()) - before
    expert_files = {p for p in opened if p.startswith(str(path))}
    assert expert_files, "no expert file was read"
    assert all(opened[p] == 1 for p in expert_files), opened
    lm.close()
    assert not {p for p in Counter(_open_fds()) - before if p.startswith(str(path))}
