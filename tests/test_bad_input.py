"""Bad model folders: one line on stderr naming the file and the problem, exit 3, no traceback."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from flashmoe.engine import EngineFailed
from flashmoe.engine.runtime.generate import GenerationRequest
from tests.helpers.cli import run_cli


@pytest.fixture
def folder(model_factory, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(model_factory("qwen3_moe", 4, converted=True), dst)
    return dst


def fails_cleanly(folder, *needles, command="run"):
    args = ("run", "-m", folder, "--max-tokens", "2", "hi") if command == "run" else (command, folder)
    r = run_cli(*args)
    assert r.returncode == 3, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashmoe: error: "), r.stderr
    for n in needles:
        assert str(n) in lines[0], lines[0]
    return lines[0]


def test_missing_expert_file(folder):
    (folder / "experts/layer_001.bin").unlink()
    fails_cleanly(folder, folder / "experts/layer_001.bin", "missing")


def test_truncated_expert_file(folder):
    f = folder / "experts/layer_002.bin"
    os.truncate(f, f.stat().st_size - 100)
    fails_cleanly(folder, f, "truncated")


def test_manifest_that_does_not_match_the_files(folder):
    m = folder / "experts/manifest.json"
    doc = json.loads(m.read_text())
    doc["layers"][0]["num_experts"] = 16
    doc["layers"][0]["checksums"] *= 2
    m.write_text(json.dumps(doc))
    fails_cleanly(folder, folder / "experts/layer_000.bin", "wrong size")


def test_manifest_shapes_that_do_not_match_the_config(folder):
    cfg = folder / "config.json"
    c = json.loads(cfg.read_text())
    c["moe_intermediate_size"] = 128
    cfg.write_text(json.dumps(c))
    fails_cleanly(folder, "manifest.json", "layer 0", "do not match the model config")


def test_broken_manifest_json(folder):
    (folder / "experts/manifest.json").write_text("{not json")
    fails_cleanly(folder, "manifest.json", "not valid JSON")


def test_unknown_model_type(folder):
    cfg = folder / "config.json"
    c = json.loads(cfg.read_text())
    c["model_type"] = "qwen9_moe"
    cfg.write_text(json.dumps(c))
    fails_cleanly(folder, "config.json", "unknown model_type 'qwen9_moe'")


def test_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    fails_cleanly(tmp_path, tmp_path, "not a model folder")
    fails_cleanly(tmp_path / "notes.txt", "notes.txt", "not a model folder")
    fails_cleanly(tmp_path / "absent", "absent", "no such file")


def test_unreadable_resident_file(folder):
    # Permissions do not stop root (CI runs as root), so make the file unreadable another way.
    f = folder / "resident.safetensors"
    f.unlink()
    f.mkdir()
    fails_cleanly(folder, f)


def test_truncated_safetensors_in_direct_mode(model_factory, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(model_factory("mixtral", 4), src)
    f = src / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    fails_cleanly(src, f, "truncated")


def test_info_and_verify_fail_cleanly_too(folder):
    (folder / "experts/layer_001.bin").unlink()
    fails_cleanly(folder, "layer_001.bin", command="info")
    fails_cleanly(folder, "layer_001.bin", command="verify")


def test_verify_names_the_corrupted_expert(folder):
    manifest = json.loads((folder / "experts/manifest.json").read_text())
    stride = manifest["layers"][1]["stride"]
    with open(folder / "experts/layer_001.bin", "r+b") as f:
        f.seek(5 * stride + 10)
        byte = f.read(1)
        f.seek(5 * stride + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = run_cli("verify", folder)
    assert r.returncode == 3 and "Traceback" not in r.stderr
    assert "layer 1 expert 5" in r.stderr and "layer_001.bin" in r.stderr
    assert r.stderr.count("checksum mismatch") == 1


def test_verify_passes_on_a_good_model(folder):
    r = run_cli("verify", folder)
    assert r.returncode == 0 and "all 24 experts in 3 layers match" in r.stderr


def test_file_truncated_after_loading_fails_the_generation_with_exit_3(folder):
    from flashmoe.engine.runtime.engine import Engine

    eng = Engine(folder, expert_cache=0)
    eng.wait_loaded()
    os.truncate(folder / "experts/layer_000.bin", 0)
    evs = list(eng.submit(GenerationRequest(prompt="hello", max_tokens=4)))
    assert isinstance(evs[-1], EngineFailed) and evs[-1].exit_code == 3
    assert "layer_000.bin" in evs[-1].message and "truncated" in evs[-1].message
    eng.close()
