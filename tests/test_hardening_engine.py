"""Hostile inputs to the engine: absurd configs, FIFOs, deep JSON, full disks, corrupted experts.

Every one must end as one line on stderr with its documented exit code (docs/usage.md), never a
traceback or a hang.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

from flashmoe.engine import EngineFailed, GenerationFinished
from flashmoe.engine.errors import ConvertError
from flashmoe.engine.runtime.generate import GenerationRequest
from tests.helpers.paths import ROOT
from tests.helpers.cli import run_cli

LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 4


@pytest.fixture
def packed(model_factory, tmp_path):
    dst = tmp_path / "packed"
    shutil.copytree(model_factory("qwen3_moe", 4, converted=True), dst)
    return dst


@pytest.fixture
def direct(model_factory, tmp_path):
    dst = tmp_path / "direct"
    shutil.copytree(model_factory("qwen3_moe", 4), dst)
    return dst


def one_line_error(r, code: int, *needles) -> str:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashmoe: error: "), r.stderr[-2000:]
    for n in needles:
        assert str(n) in lines[0], lines[0]
    return lines[0]


def edit_config(folder, **changes):
    cfg = folder / "config.json"
    c = json.loads(cfg.read_text())
    c.update(changes)
    cfg.write_text(json.dumps(c))


def run_model(folder, *extra, prompt="hi", timeout=60):
    return run_cli("run", "-m", folder, "--max-tokens", "2", *extra, prompt, timeout=timeout)


# -- 11: absurd configs fail fast ----------------------------------------------------------------

ABSURD = [
    ({"num_hidden_layers": 10**12}, "num_hidden_layers"),
    ({"num_hidden_layers": 7}, "num_hidden_layers"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"hidden_size": -64}, "hidden_size"),
    ({"hidden_size": 2**40}, "hidden_size"),
    ({"hidden_size": 4096}, "hidden_size"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 64.5}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"vocab_size": 10**9}, "vocab_size"),
    ({"num_experts": 16}, "num_experts"),
    ({"max_position_embeddings": -1}, "max_position_embeddings"),
]


@pytest.mark.parametrize("changes,key", ABSURD, ids=[k + "=" + str(list(c.values())[0]) for c, k in ABSURD])
def test_absurd_config_values_fail_fast_packed(packed, changes, key):
    edit_config(packed, **changes)
    one_line_error(run_model(packed, timeout=40), 3, "config.json", key)


@pytest.mark.parametrize("changes,key", [ABSURD[0], ABSURD[3], ABSURD[6]], ids=["layers", "top_k", "hidden"])
def test_absurd_config_values_fail_fast_direct(direct, changes, key):
    edit_config(direct, **changes)
    one_line_error(run_model(direct, timeout=40), 3, "config.json", key)


@pytest.mark.parametrize("name", ["config.json", "experts/manifest.json"])
def test_fifo_instead_of_a_json_file_is_refused(packed, name):
    (packed / name).unlink()
    os.mkfifo(packed / name)
    one_line_error(run_model(packed, timeout=30), 3, name, "not a regular file")


def test_fifo_as_config_of_info_and_convert(packed, tmp_path):
    (packed / "config.json").unlink()
    os.mkfifo(packed / "config.json")
    one_line_error(run_cli("info", packed, timeout=30), 3, "config.json", "not a regular file")
    one_line_error(run_cli("convert", packed, tmp_path / "out", timeout=30), 3, "config.json", "not a regular file")


def test_prompt_longer_than_the_context_is_refused(packed):
    edit_config(packed, max_position_embeddings=16)
    line = one_line_error(run_model(packed, "--raw", prompt=LONG_PROMPT), 2, "context", "16", "--truncate-prompt")
    assert "tokens" in line


def test_prompt_truncated_on_request_says_so(packed):
    edit_config(packed, max_position_embeddings=16)
    r = run_model(packed, "--raw", "--truncate-prompt", "left", prompt=LONG_PROMPT)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    notes = [l for l in r.stderr.splitlines() if "truncated" in l]
    assert len(notes) == 1 and "oldest" in notes[0] and "16" in notes[0], r.stderr


def test_generation_stops_at_the_context(packed):
    from flashmoe.engine.runtime.generate import Session, generate
    from flashmoe.engine.runtime.loader import load

    edit_config(packed, max_position_embeddings=20)
    loaded = load(packed)
    try:
        request = GenerationRequest(prompt="hello there", max_tokens=100)
        evs = list(generate(loaded, Session(loaded), request))
        done = evs[-1]
        assert isinstance(done, GenerationFinished) and done.reason == "context"
        assert done.prompt_tokens + done.generation_tokens == 20 + 1  # the last token is sampled, not fed
        with pytest.raises(ValueError, match="context"):
            list(generate(loaded, Session(loaded), GenerationRequest(prompt=LONG_PROMPT, max_tokens=4)))
        request = GenerationRequest(prompt=LONG_PROMPT, max_tokens=4, truncate_prompt="left")
        evs = list(generate(loaded, Session(loaded), request))
        assert evs[-1].prompt_tokens <= 20 - 4 and evs[-1].generation_tokens >= 1
    finally:
        loaded.close()


# -- 13: every mistake is one line ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text,needle",
    [
        ("[1, 2]", "not a JSON object"),
        ("null", "not a JSON object"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
    ids=["array", "null", "deep"],
)
def test_manifest_that_is_not_an_object(packed, text, needle):
    (packed / "experts/manifest.json").write_text(text)
    one_line_error(run_model(packed), 3, "manifest.json", needle)


def test_manifest_layers_of_the_wrong_kind(packed):
    m = packed / "experts/manifest.json"
    doc = json.loads(m.read_text())
    doc["layers"][0]["parts"][0]["shape"] = [-1, 64]
    m.write_text(json.dumps(doc))
    one_line_error(run_model(packed), 3, "manifest.json", "layer 0")
    doc["layers"] = {"a": 1}
    m.write_text(json.dumps(doc))
    one_line_error(run_model(packed), 3, "manifest.json")


def test_config_nested_100000_deep(packed):
    (packed / "config.json").write_text('{"model_type": "qwen3_moe", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_line_error(run_model(packed), 3, "config.json", "nested too deeply")
    one_line_error(run_cli("info", packed), 3, "config.json", "nested too deeply")


def _full_disk_after(n_calls, real):
    calls = []

    def write(*a, **k):
        calls.append(a)
        if len(calls) > n_calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*a, **k)

    return write, calls


def test_full_disk_during_convert_keeps_the_partial_and_resumes(model_factory, tmp_path, monkeypatch):
    import flashmoe.engine.formats.convert as conv

    src = model_factory("qwen3_moe", 4)
    out = tmp_path / "o"
    write, calls = _full_disk_after(2, conv.write_layer)
    monkeypatch.setattr(conv, "write_layer", write)
    with pytest.raises(ConvertError, match="No space left on device") as e:
        conv.convert(src, out)
    assert "o.partial" in str(e.value) and "again" in str(e.value)
    partial = tmp_path / "o.partial"
    kept = {n: (partial / "experts" / n).stat().st_ino for n in ("layer_000.bin", "layer_001.bin")}
    monkeypatch.undo()
    write, calls = _full_disk_after(99, conv.write_layer)
    monkeypatch.setattr(conv, "write_layer", write)
    conv.convert(src, out)
    assert len(calls) == 1  # only the layer that failed was written again
    assert not partial.exists()
    for n, ino in kept.items():
        assert (out / "experts" / n).stat().st_ino == ino


def test_full_disk_while_writing_the_resident_weights(model_factory, tmp_path, monkeypatch):
    import flashmoe.engine.formats.convert as conv

    def full(path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(conv, "write_streaming", full)
    with pytest.raises(ConvertError, match="resident.safetensors.*No space left"):
        conv.convert(model_factory("qwen3_moe", 4), tmp_path / "o")
    assert (tmp_path / "o.partial/experts/layer_002.bin").exists()


def _big_resident_source(tmp_path):
    """A 4-bit qwen3_moe with a large vocabulary: resident.safetensors is bigger than a layer file."""
    from tests import tiny_models

    tiny_models.CONFIGS.setdefault("qwen3_moe_bigvocab", dict(tiny_models.CONFIGS["qwen3_moe"], vocab_size=4096))
    return tiny_models.save_folder(tmp_path / "bigvocab", "qwen3_moe_bigvocab", bits=4)


def test_full_disk_through_the_cli(tmp_path):
    """RLIMIT_FSIZE makes every write past the limit fail with EFBIG (SIGXFSZ ignored): a real
    disk-full at the command line, no root needed. Layer files (128 KiB) fit, the resident file does not."""
    src, out = _big_resident_source(tmp_path), tmp_path / "out"
    limit = 200 * 1024

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [sys.executable, "-m", "flashmoe.cli", "convert", str(src), str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, preexec_fn=small_disk)
    assert r.returncode == 3, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("flashmoe: error: ")]
    assert len(errors) == 1 and "resident.safetensors" in errors[0] and "File too large" in errors[0], r.stderr
    assert "out.partial" in errors[0]
    partial = tmp_path / "out.partial"
    inodes = {f.name: f.stat().st_ino for f in (partial / "experts").glob("layer_*.bin")}
    assert len(inodes) == 3
    r = run_cli("convert", src, out)
    assert r.returncode == 0, r.stderr
    assert {f.name: f.stat().st_ino for f in (out / "experts").glob("layer_*.bin")} == inodes
    assert run_cli("verify", out).returncode == 0


def test_convert_never_deletes_a_partial_it_did_not_make(model_factory, tmp_path):
    mine = tmp_path / "o.partial"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    r = run_cli("convert", model_factory("qwen3_moe", 4), tmp_path / "o")
    one_line_error(r, 3, "o.partial", "not made by flashmoe convert")
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_convert_still_replaces_its_own_partial_with_other_options(model_factory, tmp_path):
    import flashmoe.engine.formats.convert as conv

    src = model_factory("qwen3_moe")
    with pytest.raises(RuntimeError, match="injected"):
        conv.convert(src, tmp_path / "o", bits=4, _fail_after_layers=1)
    conv.convert(src, tmp_path / "o", bits=8)  # its own partial, other options: started over
    assert json.loads((tmp_path / "o/config.json").read_text())["quantization"]["bits"] == 8


# -- 14: corrupted experts are caught at run time --------------------------------------------------


def flip_byte(folder, layer: int, expert: int, at: int = 10):
    manifest = json.loads((folder / "experts/manifest.json").read_text())
    entry = next(l for l in manifest["layers"] if l["layer"] == layer)
    path = folder / "experts" / entry["file"]
    with open(path, "r+b") as f:
        f.seek(expert * entry["stride"] + at)
        b = f.read(1)
        f.seek(expert * entry["stride"] + at)
        f.write(bytes([b[0] ^ 0xFF]))
    return path


def used_experts(folder, prompt: str) -> dict[int, set[int]]:
    """Which experts of each layer a generation reads (a spy on the store)."""
    from flashmoe.engine.runtime.generate import Session, generate
    from flashmoe.engine.runtime.loader import load

    loaded = load(folder)
    seen: dict[int, set[int]] = {}
    real = loaded.store.fetch

    def spy(layer, experts, *a, **k):
        seen.setdefault(layer, set()).update(int(e) for e in experts)
        return real(layer, experts, *a, **k)

    loaded.store.fetch = spy
    try:
        list(generate(loaded, Session(loaded), GenerationRequest(prompt=prompt, max_tokens=2)))
    finally:
        loaded.close()
    return seen


def test_flipped_byte_fails_the_run_with_exit_3_naming_layer_and_expert(packed):
    expert = min(used_experts(packed, "hi")[1])
    path = flip_byte(packed, 1, expert)
    line = one_line_error(run_model(packed), 3, path, "layer 1", f"expert {expert}", "checksum")
    assert "corrupted" in line
    r = run_model(packed, "--no-verify-reads")  # the switch: garbage, as before, but no exit 3
    assert r.returncode == 0, r.stderr


def test_clean_model_runs_with_verification(packed):
    r = run_model(packed)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def _engine_fails_on(folder, **load_args):
    from flashmoe.engine.runtime.engine import Engine

    eng = Engine(folder, **load_args)
    eng.wait_loaded()
    try:
        out = []
        for _ in range(2):  # the corrupted slot must not be served from the cache the second time
            evs = list(eng.submit(GenerationRequest(prompt=LONG_PROMPT, max_tokens=3)))
            out.append(evs[-1])
        return out
    finally:
        eng.close()


@pytest.mark.parametrize(
    "load_args",
    [
        dict(kernels="cpu"),
        dict(kernels="mlx"),
        dict(kernels="cpu", expert_cache=0),
        dict(kernels="mlx", prefetch="slots", expert_cache=0),
    ],
    ids=["cpu", "mlx", "cpu-no-cache", "prefetch"],
)
def test_every_read_path_checks_the_checksum(packed, load_args):
    seen = used_experts(packed, LONG_PROMPT)
    for layer in (0, 1, 2):
        for e in seen[layer]:
            flip_byte(packed, layer, e)
    for ev in _engine_fails_on(packed, **load_args):
        assert isinstance(ev, EngineFailed) and ev.exit_code == 3, ev
        assert "checksum mismatch" in ev.message and "expert" in ev.message


def test_checksum_over_pieces(packed, monkeypatch):
    """Misses are read in pieces that land in any order: the check runs once all have landed."""
    import flashmoe.engine.experts.store as store

    monkeypatch.setattr(store, "READ_PIECE", 4096)
    test_every_read_path_checks_the_checksum(packed, dict(kernels="cpu"))


def test_checksum_of_16_bit_experts_widened_on_read(model_factory, tmp_path):
    from flashmoe.engine.formats.convert import convert

    out = convert(model_factory("qwen3_moe"), tmp_path / "bf16", bits=4, dtype="bfloat16")  # bf16 scales
    seen = used_experts(out, LONG_PROMPT)
    for e in seen[1]:
        flip_byte(out, 1, e)
    for ev in _engine_fails_on(out, dtype="float32", kernels="mlx"):
        assert isinstance(ev, EngineFailed) and ev.exit_code == 3 and "layer 1" in ev.message, ev


def test_each_expert_is_checked_once_per_process(packed):
    from flashmoe.engine.runtime.loader import load

    loaded = load(packed, expert_cache=0)
    store = loaded.store
    try:
        lay = loaded.layers[0]
        for _ in range(3):
            store.fetch(lay.layer, [0, 1])
            store.fetch(lay.layer, [2, 3])  # evicts 0 and 1: they are read again next round
        assert store.verified_bytes == 4 * lay.expert_bytes
        assert store.verify_s > 0
        store.evict_all()  # a cold start (benchmarks) checks again, as a new process would
        store.fetch(lay.layer, [0, 1])
        assert store.verified_bytes == 6 * lay.expert_bytes
    finally:
        loaded.close()


def test_no_verify_reads_setting(packed):
    from flashmoe.engine.runtime.loader import load

    loaded = load(packed, verify_reads=False)
    try:
        loaded.store.fetch(0, [0, 1])
        assert loaded.store.verified_bytes == 0
    finally:
        loaded.close()
    expert = min(used_experts(packed, "hi")[1])
    flip_byte(packed, 1, expert)
    r = run_cli("run", "-m", packed, "--max-tokens", "2", "hi", env={"FLASHMOE_VERIFY_READS": "off"})
    assert r.returncode == 0, r.stderr
    r = run_cli("run", "-m", packed, "--max-tokens", "2", "hi", env={"FLASHMOE_VERIFY_READS": "maybe"})
    one_line_error(r, 2, "FLASHMOE_VERIFY_READS")


def test_bench_speed_prints_the_cost_of_verification(packed):
    r = run_cli("bench", "speed", "-m", packed, "--prompt-tokens", "8", "--tokens", "4", "--skip-disk", "--cold-only")
    assert r.returncode == 0, r.stderr
    lines = [l for l in r.stdout.splitlines() if l.startswith("verify")]
    assert len(lines) == 1 and "CRC-32" in lines[0] and "% of cold decode" in lines[0], r.stdout
