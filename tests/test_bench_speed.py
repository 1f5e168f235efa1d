"""`flashmoe bench speed` on a tiny streamed model: every figure with its conditions, JSON out."""

import json

import pytest

from tests.helpers.cli import run_cli


@pytest.fixture(scope="module")
def report(model_factory, tmp_path_factory):
    model = model_factory("qwen3_moe", 4, converted=True)
    out = tmp_path_factory.mktemp("bench") / "speed.json"
    r = run_cli(
        "bench",
        "speed",
        "-m",
        model,
        "--tokens",
        6,
        "--prompt-tokens",
        8,
        "--expert-cache",
        "1",
        "--kernels",
        "cpu",
        "--no-page-cache",
        "--out",
        out,
        timeout=300,
        env={"FLASHMOE_HOME": str(tmp_path_factory.mktemp("home"))},
    )
    assert r.returncode == 0, r.stderr
    return r.stdout, json.loads(out.read_text()), out


def test_prints_the_conditions_of_every_figure(report):
    stdout, result, _ = report
    assert "4-bit" in result["model_line"] and "K=" in result["model_line"] and "expert cache" in result["model_line"]
    assert "prefetch off" in result["model_line"] and "(lfu)" in result["model_line"]
    assert result["machine"] and result["disk"]["random_gbps"] > 0 and result["disk"]["sequential_gbps"] > 0
    lines = [line for line in stdout.splitlines() if " | decode " in line]
    assert [line.split(":")[0].strip() for line in lines] == ["warm", "cold", "uncached"]
    for line in lines:
        for what in (
            "prefill 8 tok",
            "decode 6 tok",
            "tok/s",
            "/token read (theory",
            "hit rate",
            "io wait",
            "from the device",
            "roof fraction",
            "overlap",
        ):
            assert what in line, (what, line)
    assert "disk limit" in lines[1] and "disk limit" in lines[2]
    assert "as for a model larger than RAM" in stdout


def test_bytes_read_match_the_theory_and_cold_starts_empty(report):
    _, result, _ = report
    warm, cold, uncached = result["runs"]
    assert [r["cache_state"] for r in result["runs"]] == ["warm", "cold", "cold"]
    assert [r["page_cache_dropped_every_token"] for r in result["runs"]] == [False, False, True]
    for run in (warm, cold, uncached):
        assert run["prompt_tokens"] == 8 and run["generated_tokens"] == 6
        assert 0 <= run["hit_rate"] < 1  # the cache holds K experts: some reads every token
        assert run["bytes_per_token"] > 0
        assert run["bytes_per_token"] == pytest.approx(run["theory_bytes_per_token"], rel=0.02)
        assert run["device_bytes_per_token"] is not None and run["device_bytes_per_token"] >= 0
    assert uncached["decode_tps"] > 0
    if cold["device_bytes_per_token"]:  # files on a block device (not tmpfs): every read of "uncached" hits it
        assert uncached["device_bytes_per_token"] >= 0.9 * uncached["bytes_per_token"]
    for run in (warm, cold, uncached):  # the share of the disk's roof, and of decode with a read in flight
        assert 0 <= run["overlap"] <= 1
        if run["device_bytes_per_token"]:
            assert run["roof_fraction"] == pytest.approx(
                run["decode_tps"] * run["device_bytes_per_token"] / (result["disk"]["random_gbps"] * 1e9)
            )
    assert cold["overlap"] > 0  # an expert cache of one token's experts reads every step
    # the disk limit is the measured random-read rate over the bytes read per token
    assert cold["disk_limit_tps"] == pytest.approx(result["disk"]["random_gbps"] * 1e9 / cold["bytes_per_token"])


def test_json_is_written_whole(report):
    _, _, out = report
    assert not list(out.parent.glob("*.partial"))


def test_page_cache_drop_time_is_left_out_of_decode_speed(model_factory, monkeypatch):
    """--no-page-cache drops the page cache between tokens; that time is the benchmark's, not the
    engine's, so decode speed must not include it. Each drop is made to take 10 s on the clock
    both the benchmark and the generator read (without sleeping), so a single drop counted into
    decode time would bring 7 decoded tokens under 0.7 tok/s, however loaded the machine is."""
    import time

    from flashmoe.engine import benchmark
    from flashmoe.engine.runtime import generate
    from flashmoe.engine.runtime.loader import load

    lm = load(model_factory("qwen3_moe", 4, converted=True), kernels="cpu", expert_cache=1)
    prompt = benchmark.prompt_of(lm.tokenizer, 8)
    benchmark.run_generation(lm, prompt, 2, cold=False)
    plain = benchmark.run_generation(lm, prompt, 8, cold=True)
    real, skipped, drops = time.perf_counter, [0.0], []

    def clock():
        return real() + skipped[0]

    def slow_drop(files):
        skipped[0] += 10.0
        drops.append(1)

    monkeypatch.setattr(time, "perf_counter", clock)
    monkeypatch.setattr(generate, "perf_counter", clock)
    monkeypatch.setattr(benchmark, "evict", slow_drop)
    dropped = benchmark.run_generation(lm, prompt, 8, cold=True, drop_every_token=True)
    assert len(drops) >= 8  # before the run and after every token
    assert dropped.page_cache_dropped_every_token and not plain.page_cache_dropped_every_token
    assert dropped.generated_tokens == 8
    assert dropped.decode_tps > 1.0, (dropped.decode_tps, plain.decode_tps)
    assert 0 <= dropped.io_wait_share <= 1


@pytest.mark.parametrize(
    "args,message",
    [
        (("--tokens", "0"), "--tokens: must be at least 1"),
        (("--rounds", "-1"), "--rounds: must be at least 1"),
        (("--prompt-tokens", "many"), "not a whole number"),
        (("--io-threads", "0"), "--io-threads"),
        (("--dtype", "fp8"), "--dtype: invalid choice"),
        (("--out", "/nonexistent-dir/r.json"), "does not exist"),
    ],
)
def test_bad_arguments_fail_before_any_work(args, message, tmp_path):
    # The model folder does not exist either: had the benchmark started, that would be the error.
    r = run_cli("bench", "speed", "-m", tmp_path / "absent", *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not r.stdout


def test_prompt_lengths_give_a_scaling_table_and_json(model_factory, tmp_path):
    model = model_factory("qwen3_moe", 4, converted=True)
    out = tmp_path / "scaling.json"
    r = run_cli(
        "bench",
        "speed",
        "-m",
        model,
        "--tokens",
        4,
        "--prompt-tokens",
        8,
        "--skip-disk",
        "--cold-only",
        "--kernels",
        "cpu",
        "--prompt-lengths",
        "16,80",
        "--out",
        out,
        timeout=300,
        env={"FLASHMOE_HOME": str(tmp_path / "home")},
    )
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["scaling"]
    assert [row["prompt_tokens"] for row in rows] == [16, 80]
    assert all(row["prefill_tps"] > 0 and row["decode_tps"] > 0 and row["generated_tokens"] == 4 for row in rows)
    table = r.stdout[r.stdout.index("scaling :") :].splitlines()
    assert "prefill tok/s" in table[1] and "decode tok/s" in table[1]
    assert [line.split("|")[0].strip() for line in table[2:4]] == ["16", "80"]


def test_prompt_lengths_must_be_token_counts(tmp_path):
    r = run_cli("bench", "speed", "--prompt-lengths", "128,0", env={"FLASHMOE_HOME": str(tmp_path)})
    assert r.returncode == 2 and "'0' is not a token count (like 128, 1k, 4k)" in r.stderr
