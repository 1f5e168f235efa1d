"""The memory budget comes from what the process may really use (engine/runtime/memory.py).

Limits are read from a fake /proc and /sys/fs/cgroup tree under tmp_path: no root needed. The
layouts follow the kernel's documentation (Documentation/admin-guide/cgroup-v1/memory.rst and
cgroup-v2.rst: memory.limit_in_bytes, memory.usage_in_bytes, memory.stat total_inactive_file;
memory.max, memory.high, memory.current, memory.stat inactive_file) and /proc/self/mountinfo as
proc(5) describes it; the v1 "no limit" value is what this machine's root group shows."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from flashmoe.engine.runtime import memory
from flashmoe.engine.runtime.memory import Limit, MemoryTooSmall, plan, read_limit

GB, MB = 10**9, 10**6
NO_LIMIT_V1 = 9223372036854771712


def write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def fake_tree(
    root: Path,
    *,
    v1: dict | None = None,
    v2: dict | None = None,
    v1_path="/",
    v2_path="/",
    mount_root="/",
    available=16 * GB,
    vm_size=1 * GB,
    vm_data=512 * MB,
) -> Path:
    """A /proc and /sys/fs/cgroup under `root`. v1 / v2: {group path: files} for the memory
    controller's folders (group paths relative to the mount)."""
    cgroup, mounts = [], []
    if v1 is not None:
        cgroup.append(f"4:memory:{v1_path}")
        mounts.append(f"35 25 0:31 {mount_root} /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory")
        for group, files in v1.items():
            for name, value in files.items():
                write(root, f"sys/fs/cgroup/memory/{group.strip('/')}/{name}".replace("//", "/"), str(value))
    if v2 is not None:
        cgroup.append(f"0::{v2_path}")
        mounts.append(f"30 25 0:27 {mount_root} /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw")
        for group, files in v2.items():
            for name, value in files.items():
                write(root, f"sys/fs/cgroup/{group.strip('/')}/{name}".replace("//", "/"), str(value))
    mounts.insert(0, "22 1 8:1 / / rw,relatime - ext4 /dev/vda rw")
    write(root, "proc/self/cgroup", "\n".join(cgroup) + "\n")
    write(root, "proc/self/mountinfo", "\n".join(mounts) + "\n")
    write(
        root,
        "proc/meminfo",
        f"MemTotal:       25000000 kB\nMemFree:        1000 kB\nMemAvailable:   {available // 1024} kB\n",
    )
    write(root, "proc/self/status", f"Name:\tpython\nVmSize:\t{vm_size // 1024} kB\nVmData:\t{vm_data // 1024} kB\n")
    return root


def v1_files(limit, usage, inactive=0):
    return {
        "memory.limit_in_bytes": limit,
        "memory.usage_in_bytes": usage,
        "memory.stat": f"cache 1\nrss 2\ntotal_inactive_file {inactive}\n",
    }


def test_v1_limit_is_read_along_the_process_path_and_the_tightest_decides(tmp_path):
    root = fake_tree(
        tmp_path,
        v1_path="/user.slice/job",
        v1={
            "/": v1_files(NO_LIMIT_V1, 5 * GB),
            "/user.slice": v1_files(3 * GB, 2 * GB),  # the parent leaves 1 GB
            "/user.slice/job": v1_files(4 * GB, 1 * GB),  # the group itself would leave 3 GB
        },
    )
    lim = read_limit(root, rlimits={})
    assert lim.available == 1 * GB and lim.total == 3 * GB
    assert lim.source.startswith("cgroup v1 /user.slice:") and "limit 3.00 GB" in lim.source
    assert any(o.startswith("cgroup v1 /user.slice/job:") for o in lim.others)


def test_inactive_file_pages_are_reclaimable_and_not_counted_as_used(tmp_path):
    root = fake_tree(tmp_path, v1_path="/job", v1={"/job": v1_files(4 * GB, 3 * GB, inactive=2 * GB)})
    assert read_limit(root, rlimits={}).available == 3 * GB


def test_no_cgroup_limit_leaves_mem_available(tmp_path):
    root = fake_tree(
        tmp_path,
        v1_path="/job",
        v1={"/": v1_files(NO_LIMIT_V1, GB), "/job": v1_files(NO_LIMIT_V1, GB)},
        available=7 << 30,
    )
    lim = read_limit(root, rlimits={})
    assert lim.available == 7 << 30 and lim.source.startswith("MemAvailable")


def test_mem_available_decides_when_it_is_below_the_cgroup(tmp_path):
    root = fake_tree(tmp_path, v1_path="/job", v1={"/job": v1_files(8 * GB, GB)}, available=2 * GB)
    assert read_limit(root, rlimits={}).source.startswith("MemAvailable 2.00 GB")


def test_v2_takes_memory_high_and_memory_max_along_the_path(tmp_path):
    root = fake_tree(
        tmp_path,
        v2_path="/system.slice/flashmoe.service",
        v2={
            "/system.slice": {
                "memory.max": "max",
                "memory.high": "max",
                "memory.current": 3 * GB,
                "memory.stat": "anon 1\ninactive_file 0\n",
            },
            "/system.slice/flashmoe.service": {
                "memory.max": 6 * GB,
                "memory.high": 5 * GB,
                "memory.current": 2 * GB,
                "memory.stat": f"inactive_file {GB}\n",
            },
        },
    )
    lim = read_limit(root, rlimits={})
    assert lim.available == 4 * GB and lim.total == 5 * GB  # high, less 1 GB that cannot be reclaimed
    assert lim.source.startswith("cgroup v2 /system.slice/flashmoe.service:")


def test_a_container_sees_its_own_group_as_the_mount_root(tmp_path):
    # docker without a cgroup namespace: /proc/self/cgroup names /docker/abc, which is mounted as /
    root = fake_tree(tmp_path, v1_path="/docker/abc", mount_root="/docker/abc", v1={"/": v1_files(2 * GB, 500 * MB)})
    lim = read_limit(root, rlimits={})
    assert lim.available == 1500 * MB and lim.source.startswith("cgroup v1 /:")


def test_hybrid_v1_and_v2_both_count(tmp_path):
    root = fake_tree(
        tmp_path,
        v1_path="/a",
        v1={"/a": v1_files(10 * GB, GB)},
        v2_path="/b",
        v2={"/b": {"memory.max": 3 * GB, "memory.current": GB, "memory.stat": ""}},
    )
    assert read_limit(root, rlimits={}).available == 2 * GB


def test_rlimits_count_against_what_is_already_mapped(tmp_path):
    root = fake_tree(tmp_path, vm_size=3 * 2**30, vm_data=2**30)
    lim = read_limit(root, rlimits={"RLIMIT_AS": 5 * 2**30, "RLIMIT_DATA": None})
    assert lim.available == 2 * 2**30 and lim.source.startswith("RLIMIT_AS")
    lim = read_limit(root, rlimits={"RLIMIT_AS": None, "RLIMIT_DATA": 2 * 2**30})
    assert lim.available == 2**30 and lim.source.startswith("RLIMIT_DATA")


def test_unreadable_or_garbage_files_are_no_limit(tmp_path):
    root = fake_tree(
        tmp_path, v1_path="/job", v1={"/job": {"memory.limit_in_bytes": "lots", "memory.stat": "x"}}, available=5 << 30
    )
    assert read_limit(root, rlimits={}).available == 5 << 30


# -- the plan ------------------------------------------------------------------------------------


def a_plan(
    available,
    *,
    total=None,
    resident=300 * MB,
    working=300 * MB,
    kv=100_000,
    ctx=None,
    experts=8 * GB,
    cache=None,
    prompt=0,
    model_context=32768,
):
    return plan(
        Limit(available, "test limit", total),
        resident=resident,
        working=working,
        kv_per_token=kv,
        model_context=model_context,
        all_experts=experts,
        min_experts=20 * MB,
        ctx_size=ctx,
        prompt_cache=prompt,
        expert_cache=cache,
    )


@settings(max_examples=200, deadline=None)
@given(
    available=st.integers(800 * MB, 64 * GB),
    resident=st.integers(10 * MB, 2 * GB),
    kv=st.integers(1_000, 500_000),
    experts=st.integers(50 * MB, 500 * GB),
    prompt=st.sampled_from([0, 2 << 30]),
    ctx=st.one_of(st.none(), st.integers(256, 8192)),
)
def test_the_default_plan_never_exceeds_what_is_available(available, resident, kv, experts, prompt, ctx):
    try:
        p = a_plan(available, resident=resident, kv=kv, experts=experts, prompt=prompt, ctx=ctx)
    except MemoryTooSmall:
        return
    used = p.resident + p.working + p.kv + p.prompt_caches + p.expert_cache + p.margin
    assert used <= available
    assert 20 * MB <= p.expert_cache <= experts
    assert p.context >= 256 and (ctx is None or p.context == ctx)


def test_everything_fits_on_a_big_machine():
    p = a_plan(20 * GB, experts=8 * GB)
    assert p.expert_cache == 8 * GB and p.context == 32768 and not p.notes


def test_a_tight_limit_shares_the_room_between_experts_and_context():
    p = a_plan(2 * GB, total=2 * GB)
    assert p.context < 32768 and p.kv <= (2 * GB - p.resident - p.working - p.margin) * memory.CONTEXT_SHARE
    assert p.expert_cache == 2 * GB - p.resident - p.working - p.margin - p.kv
    assert any("--ctx-size" in n for n in p.notes)


def test_the_resident_part_that_does_not_fit_is_refused_naming_both_figures():
    with pytest.raises(MemoryTooSmall) as e:
        a_plan(700 * MB, total=800 * MB, resident=600 * MB)
    text = str(e.value)
    assert (
        "needs at least" in text and "resident weights 600 MB" in text and "may take 700 MB more (test limit)" in text
    )


def test_an_explicit_cache_over_the_budget_is_kept_with_a_note_naming_both():
    p = a_plan(2 * GB, total=2 * GB, cache=6 * GB)
    assert p.expert_cache == 6 * GB
    assert any(n.startswith("--expert-cache 6.00 GB is more than the") and "test limit" in n for n in p.notes)


def test_the_servers_prompt_caches_are_capped_by_the_budget():
    p = a_plan(3 * GB, total=3 * GB, prompt=2 << 30)
    assert 0 < p.prompt_caches < 2 << 30 and any("prompt caches" in n for n in p.notes)
    assert a_plan(40 * GB, prompt=2 << 30).prompt_caches == 2 << 30


# -- through the loader and the CLI ---------------------------------------------------------------


@pytest.fixture
def limited(tmp_path, monkeypatch):
    """Point the engine's limit at a fake cgroup of `limit` bytes with `used` in use."""

    def set_limit(limit, used=100 * MB):
        root = fake_tree(tmp_path / "sysroot", v1_path="/job", v1={"/job": v1_files(limit, used)}, available=20 * GB)
        monkeypatch.setattr(memory, "SYS_ROOT", root)
        monkeypatch.setattr(memory, "_rlimits", lambda: {})
        return root

    return set_limit


def test_load_under_a_cgroup_limit_gets_an_expert_cache_that_fits(model_factory, limited):
    from flashmoe.engine.runtime.loader import load

    path = model_factory("qwen3_moe", 4, converted=True)
    everything = load(path, load_tokenizer=False, kernels="cpu")
    all_bytes = everything.store.capacity_bytes
    resident = everything.memory.resident
    # a limit with room for the resident part, the kernels, a 256-token KV cache and half the experts
    need = resident + everything.memory.working + memory.MARGIN_MIN + 256 * everything.memory.kv_per_token
    limited(100 * MB + need + all_bytes // 2)
    lm = load(path, load_tokenizer=False, kernels="cpu", ctx_size=256)
    p = lm.memory
    assert p.limit.source.startswith("cgroup v1 /job:")
    assert lm.store.capacity_bytes <= p.expert_cache + max(pool.expert_bytes for pool in lm.store.pools)
    assert p.resident + p.working + p.kv + p.expert_cache + p.margin <= p.limit.available
    assert lm.store.capacity_bytes < all_bytes  # it really was held to the limit


def test_a_limit_below_the_resident_part_is_one_line_and_exit_3(model_factory, limited, capsys, monkeypatch):
    from flashmoe.cli import cli

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    path = model_factory("qwen3_moe", 4, converted=True)
    limited(250 * MB, used=200 * MB)
    assert cli.main(["run", "-m", str(path), "--max-tokens", "2", "-n", "hi"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashmoe: error: ") and "needs at least" in err[0], err
    assert "may take 50 MB more (cgroup v1 /job: limit 250 MB, 200 MB in use)" in err[0]


def test_an_explicit_expert_cache_over_the_budget_warns_naming_both(model_factory, limited, caplog):
    from flashmoe.engine.runtime.loader import load

    path = model_factory("qwen3_moe", 4, converted=True)
    limited(1 * GB)
    with caplog.at_level(logging.WARNING, logger="flashmoe"):
        lm = load(path, load_tokenizer=False, kernels="cpu", expert_cache=5 * GB)
    assert lm.memory.expert_cache == 5 * GB
    assert any(
        "--expert-cache 5.00 GB is more than the" in r.getMessage() and "cgroup v1 /job" in r.getMessage()
        for r in caplog.records
    )


def test_info_prints_the_budget_and_where_it_came_from(model_factory, limited, capsys):
    from flashmoe.cli import cli

    path = model_factory("qwen3_moe", 4, converted=True)
    limited(3 * GB)
    assert cli.main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "memory limit: cgroup v1 /job: limit 3.00 GB, 100 MB in use" in out
    assert "memory budget:" in out and "resident weights" in out and "expert cache:" in out


def test_a_prompt_past_the_planned_context_is_refused_naming_ctx_size(model_factory, limited, capsys, monkeypatch):
    from flashmoe.cli import cli

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    path = model_factory("qwen3_moe", 4, converted=True)
    limited(3 * GB)
    assert (
        cli.main(["run", "-m", str(path), "--ctx-size", "256", "--max-tokens", "2", "-n", "--raw", "word " * 400]) == 2
    )
    err = capsys.readouterr().err
    assert "the context of 256 tokens the memory budget leaves room for" in err and "--ctx-size" in err
