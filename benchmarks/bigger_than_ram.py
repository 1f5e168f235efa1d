#!/usr/bin/env python3
"""Bigger than memory: flashmoe and llama.cpp on a MoE whose experts do not fit, side by side.

The job flashmoe exists for. Both engines run the synthetic qwen3_moe of side_by_side.py
(24 layers, 128 experts top-8, 4-bit, random weights: random routing, the worst case for any
cache) inside a memory cgroup this script makes, whose limit counts the page cache, at limits of
a share of the model's size (default 1/4, 1/2, 1x and 1.5x). The page cache is dropped before
every run. flashmoe runs with its defaults (no --expert-cache: the memory plan decides);
llama.cpp mmaps the GGUF, with its repacked CPU buffers off (`use_extra_bufts=False`) and, as a
separate row, on (its default, which copies Q4_0 weights into anonymous memory).

Per run: prefill tok/s, decode tok/s of the first 16 tokens and of the rest (the steady state),
bytes from the device per decoded token (/proc/self/io read_bytes), the disk roof measured in
the same sitting (O_DIRECT random reads of the engine's read size at its queue depth, cold),
the roof fraction (tok/s x device bytes per token / roof GB/s), the overlap (flashmoe: the share
of decode during which a read was at the device), the expert cache's hit rate, major page faults
per token, and the cgroup's peak memory. A run the kernel kills says so.

    sudo python benchmarks/bigger_than_ram.py --synthetic-dir /tmp/fm-synth --out /tmp/btr.json

Needs root (it makes cgroups and drops the page cache); without it, it prints one line and
exits 0. The synthetic model is built on first use (~9 minutes, ~17 GB) or reused from
--synthetic-dir. llama-cpp-python is optional (`pip install llama-cpp-python==0.3.36`); without
it the llama.cpp rows are skipped. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_common import cpu_model, source_revision  # noqa: E402

RESULT_TAG = "BIGGER_THAN_RAM_RESULT "
FIRST = 16  # the tokens after a cold start measured on their own
WARMUP = 96  # tokens that read nearly every expert once (random routing, 8 of 128: all but 0.2%)


# -- cgroups ----------------------------------------------------------------------------------


class Cgroup:
    """A memory cgroup under this process's own (v1 or v2), with a limit, for one child."""

    def __init__(self, limit: int, name: str):
        from flashmoe.engine.runtime.memory import SYS_ROOT, _groups

        groups = _groups(SYS_ROOT)
        v1 = [g for g in groups if g[0] == "v1"]
        version, parent, _ = (v1 or groups)[0]
        self.version = version
        self.path = parent / name
        self.path.mkdir(exist_ok=True)
        if version == "v1":
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
        else:
            (parent / "cgroup.subtree_control").write_text("+memory")
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")

    def enter(self) -> None:
        """Move the calling process in (a child's preexec_fn)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            for line in (self.path / name).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def remove(self) -> None:
        if self.version == "v1":
            try:
                (self.path / "memory.force_empty").write_text("0")
            except OSError:
                pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def can_run() -> str | None:
    """Why this script cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root: it makes memory cgroups and drops the page cache"
    try:
        from flashmoe.engine.runtime.memory import SYS_ROOT, _groups

        if not _groups(SYS_ROOT):
            return "no memory cgroup hierarchy is mounted"
    except Exception as e:  # noqa: BLE001
        return f"cannot read the cgroups: {e}"
    return None


# -- the drive --------------------------------------------------------------------------------


def disk_roof(files: list[Path], block: int, depth: int, seconds: float = 4.0) -> float:
    """Cold O_DIRECT random reads of `block` bytes, `depth` in flight, over `files`: GB/s. Offsets
    are drawn afresh (a virtual disk's host may cache what the last measurement read)."""
    rng = random.Random()
    fds = [(os.open(f, os.O_RDONLY | os.O_DIRECT), f.stat().st_size) for f in files]
    local = threading.local()
    stop = time.perf_counter() + seconds

    def worker(_):
        local.buf = getattr(local, "buf", None) or mmap.mmap(-1, block)
        got = 0
        while time.perf_counter() < stop:
            fd, size = rng.choice(fds)
            got += os.preadv(fd, [local.buf], rng.randrange(0, size // block) * block)
        return got

    t0 = time.perf_counter()
    with ThreadPoolExecutor(depth) as pool:
        total = sum(pool.map(worker, range(depth)))
    gbps = total / (time.perf_counter() - t0) / 1e9
    for fd, _ in fds:
        os.close(fd)
    return gbps


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def major_faults() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])


def token_figures(times: list[float], marks: list[dict]) -> dict:
    """Decode figures from each token's time and the counters read at it (marks[i] at times[i])."""
    n = len(times)
    out = {"generated": n}
    if n < 2:
        return out
    out["decode_tps"] = (n - 1) / (times[-1] - times[0])
    f = min(FIRST, n - 1)
    out["first16_tps"] = f / (times[f] - times[0])
    if n - 1 > f:
        out["steady_tps"] = (n - 1 - f) / (times[-1] - times[f])
    d = marks[-1]
    out["device_bytes_per_token"] = (d["io"] - marks[0]["io"]) / (n - 1)
    out["major_faults_per_token"] = (d["majflt"] - marks[0]["majflt"]) / (n - 1)
    if "busy" in d:
        out["overlap"] = (d["busy"] - marks[0]["busy"]) / (times[-1] - times[0])
        if n - 1 > f:
            out["steady_overlap"] = (d["busy"] - marks[f]["busy"]) / (times[-1] - times[f])
            out["steady_device_bytes_per_token"] = (d["io"] - marks[f]["io"]) / (n - 1 - f)
    return out


# -- children: one engine, one run, in its own cgroup -----------------------------------------


def child_flashmoe(spec: dict) -> dict:
    from flashmoe.engine.events import GenerationFinished, TokenGenerated
    from flashmoe.engine.runtime.generate import GenerationRequest, Session, generate
    from flashmoe.engine.runtime.loader import load

    from flashmoe.engine.experts import store as store_module

    for name, value in spec.get("store", {}).items():  # an A/B of one of the store's constants
        assert hasattr(store_module, name), name
        setattr(store_module, name, value)
    t0 = time.perf_counter()
    lm = load(spec["path"], kernels="auto", **spec.get("load", {}))
    load_s = time.perf_counter() - t0
    lm.tokenizer.eos_token_ids = frozenset()  # exactly `gen` tokens
    store = lm.store
    if spec.get("warmup"):  # the compute roof's run: first read (nearly) every expert into the cache
        for _ in generate(
            lm, Session(lm), GenerationRequest(prompt=spec["prompt"], max_tokens=spec["warmup"], timing="off")
        ):
            pass
    req = GenerationRequest(prompt=spec["prompt"], max_tokens=spec["gen"], timing="off")
    times, marks, done = [], [], None
    io0 = read_bytes()
    for ev in generate(lm, Session(lm), req):
        if isinstance(ev, TokenGenerated):
            times.append(time.perf_counter())
            marks.append({"io": read_bytes(), "majflt": major_faults(), "busy": store.busy.now()})
        elif isinstance(ev, GenerationFinished):
            done = ev
    out = token_figures(times, marks)
    p = lm.memory
    out.update(
        load_s=load_s,
        prompt_tokens=done.prompt_tokens,
        prefill_tps=done.prompt_tps,
        prefill_s=done.prefill_s,
        prefill_device_bytes=marks[0]["io"] - io0 if marks else None,
        hit_rate=done.hit_rate,
        bytes_per_token=done.bytes_per_token,
        expert_cache_bytes=store.capacity_bytes,
        all_expert_bytes=p.all_experts,
        context=p.context,
        plan=[list(r) for r in p.lines()],
        text=done.text[:200],
        direct_io=store.direct_io,
        verify_s=store.verify_s,
    )
    lm.close()
    return out


def child_llama(spec: dict) -> dict:
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    if not spec["repack"]:  # llama.cpp's repacked CPU buffers off (they crash on some of these hosts)
        default = lc.llama_model_default_params

        def no_extra_bufts():
            p = default()
            p.use_extra_bufts = False
            return p

        lc.llama_model_default_params = no_extra_bufts
    ids = spec["ids"]
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=spec["path"],
        n_threads=spec["threads"],
        n_threads_batch=spec["threads"],
        n_ctx=max(512, len(ids) + spec["gen"] + 16),
        n_batch=512,
        seed=0,
        verbose=False,
        use_mmap=True,
    )
    load_s = time.perf_counter() - t0
    times, marks = [], []
    t = time.perf_counter()
    io0 = read_bytes()
    for _tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        times.append(time.perf_counter())
        marks.append({"io": read_bytes(), "majflt": major_faults()})
        if len(times) >= spec["gen"]:
            break
    out = token_figures(times, marks)
    out.update(
        load_s=load_s,
        prompt_tokens=len(ids),
        prefill_s=times[0] - t,
        prefill_tps=len(ids) / (times[0] - t),
        prefill_device_bytes=marks[0]["io"] - io0,
    )
    return out


CHILDREN = {"flashmoe": child_flashmoe, "llama.cpp": child_llama}


def run_child(spec: dict, limit: int, timeout: float, name: str) -> dict:
    drop_page_cache()
    group = Cgroup(limit, name)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), preexec_fn=group.enter
        )
        out = next(
            (
                json.loads(line[len(RESULT_TAG) :])
                for line in reversed(proc.stdout.splitlines())
                if line.startswith(RESULT_TAG)
            ),
            None,
        )
        if out is None:
            kills = group.oom_kills()
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            out = {
                "failed": (
                    "killed by the kernel's OOM killer" if kills or proc.returncode == -9 else f"exit {proc.returncode}"
                )
                + (": " + " | ".join(tail) if tail else "")
            }
    except subprocess.TimeoutExpired:
        out = {"failed": f"timed out after {timeout:.0f} s"}
    out.update(peak_bytes=group.peak(), oom_kills=group.oom_kills(), child_wall_s=time.perf_counter() - t0)
    group.remove()
    return out


def serve_stream(fm: Path, limit: int, prompts: list[str], timeout: float, name: str) -> dict:
    """`flashmoe serve` with its defaults inside a cgroup of `limit`: the prompts sent as a stream
    by two clients at once (/v1/completions, 8 tokens each; every prompt cached in memory after
    its reply, so the prompt caches grow as they would). Whether the server lived through it, each
    reply's status, the cgroup's peak."""
    import urllib.request

    drop_page_cache()
    group = Cgroup(limit, name)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flashmoe.cli", "serve", "-m", str(fm), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(ROOT),
        preexec_fn=group.enter,
    )
    base = f"http://127.0.0.1:{port}"
    up = time.perf_counter() + timeout
    while time.perf_counter() < up and proc.poll() is None:
        try:
            urllib.request.urlopen(base + "/health", timeout=5).read()
            break
        except OSError:
            time.sleep(1)

    def send(prompt: str) -> tuple[int | str, float]:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
        t = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                r.read()
                return r.status, time.perf_counter() - t
        except urllib.error.HTTPError as e:
            return e.code, time.perf_counter() - t
        except OSError as e:
            return f"{type(e).__name__}: {e}", time.perf_counter() - t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(send, prompts))
    alive = proc.poll() is None
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    out = {
        "requests": len(prompts),
        "statuses": [r[0] for r in replies],
        "seconds": [round(r[1], 1) for r in replies],
        "alive_at_end": alive,
        "exit": proc.returncode,
        "peak_bytes": group.peak(),
        "oom_kills": group.oom_kills(),
        "wall_s": time.perf_counter() - t0,
        "stderr_tail": (err or "").strip().splitlines()[-3:],
    }
    group.remove()
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the sitting --------------------------------------------------------------------------------


def model_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic-dir", type=Path, default=Path("/tmp/fm-side-by-side-synthetic"))
    p.add_argument("--limits", default="0.25,0.5,1,1.5", help="memory limits as shares of the model's size")
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument(
        "--llama-gen-tokens",
        type=int,
        default=24,
        help="tokens for llama.cpp below 1x (it runs at a fraction of a token a second there)",
    )
    p.add_argument("--prefill-tokens", type=int, default=1024, help="the cold prefill run's prompt (0: none)")
    p.add_argument("--engines", default="flashmoe,llama.cpp,llama.cpp-repack")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--flashmoe-load", default="{}", help="JSON of extra load() arguments (e.g. for an A/B)")
    p.add_argument(
        "--flashmoe-store",
        default="{}",
        help='JSON of the expert store\'s constants to set (an A/B, e.g. {"READ_PIECE": 2097152})',
    )
    p.add_argument("--flashmoe-path", type=Path, help="flashmoe's folder, instead of the synthetic one built here")
    p.add_argument(
        "--serve-limit",
        type=float,
        default=0.5,
        help="run `flashmoe serve` under this share of the model's size with a stream of requests (0: no)",
    )
    p.add_argument("--serve-requests", type=int, default=16)
    p.add_argument("--no-compute-roof", action="store_true", help="skip the all-cached run (an A/B)")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        spec = json.loads(a.child)
        print(RESULT_TAG + json.dumps(CHILDREN[spec["engine"]](spec)), flush=True)
        return 0
    why = can_run()
    if why:
        print(f"bigger_than_ram: skipped: {why}")
        return 0

    import side_by_side as sbs
    from flashmoe.engine.benchmark import prompt_of
    from flashmoe.engine.experts.store import READ_PIECE
    from flashmoe.engine.options import IO_THREADS
    from flashmoe.engine.runtime.tokenizer import Tokenizer

    home = Path(os.environ.get("FLASHMOE_HOME", "/tmp/fmhome"))
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    synth = a.synthetic_dir
    fm, gguf = synth / "flashmoe-4bit", synth / "synthetic-q4_0.gguf"
    if not (fm / "experts" / "manifest.json").exists() or not gguf.exists():
        dense = sbs.prepare_dense(synth / "dense", home, log)
        sbs.prepare_synthetic(synth, dense, home, log)
    fm = a.flashmoe_path or fm
    size = model_bytes(fm)
    tok = Tokenizer.from_folder(fm)
    short = sbs.RAW_PROMPT
    long = prompt_of(tok, a.prefill_tokens) if a.prefill_tokens else None
    ids = {"short": tok.encode(short, add_special_tokens=True)}
    if long:
        ids["long"] = tok.encode(long, add_special_tokens=True)
    engines = [e for e in a.engines.split(",") if e]
    llama = None
    try:
        from importlib.metadata import version

        llama = version("llama-cpp-python")
    except Exception:  # noqa: BLE001
        engines = [e for e in engines if not e.startswith("llama")]
    files = sorted((fm / "experts").glob("layer_*.bin"))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{os.cpu_count()}x {cpu_model()}",
        "revision": source_revision(),
        "model": sbs.SYN,
        "model_bytes": size,
        "llama_cpp": llama,
        "threads": a.threads,
        "gen_tokens": a.gen_tokens,
        "prompt_tokens": {k: len(v) for k, v in ids.items()},
        "read_piece": READ_PIECE,
        "rows": [],
    }
    print(f"# bigger than memory: {result['date']}, {result['machine']}, {result['revision']}", flush=True)
    print(
        f"# model: synthetic qwen3_moe, {size / 1e9:.2f} GB on disk; prompts {result['prompt_tokens']} tokens; "
        f"{a.gen_tokens} tokens decoded; {a.threads} threads; llama-cpp-python {llama}",
        flush=True,
    )
    n = 0
    if (
        "flashmoe" in engines and not a.no_compute_roof
    ):  # the compute roof: decode with every expert cached, no limit, no reads
        n += 1
        out = run_child(
            {
                "engine": "flashmoe",
                "path": str(fm),
                "prompt": short,
                "gen": a.gen_tokens,
                "warmup": WARMUP,
                "load": json.loads(a.flashmoe_load),
                "store": json.loads(a.flashmoe_store),
            },
            1 << 50,
            a.timeout,
            f"flashmoe-btr-{os.getpid()}-{n}",
        )
        result["compute_roof"] = out
        print(
            f"# compute roof: flashmoe decode {out.get('steady_tps', 0):.2f} tok/s with its cache warmed by "
            f"{WARMUP} tokens (hit {out.get('hit_rate', 0):.1%}, no memory limit): no limit's decode can pass it",
            flush=True,
        )
    for share in [float(x) for x in a.limits.split(",")]:
        limit = int(size * share)
        drop_page_cache()
        roof = disk_roof(files, READ_PIECE, IO_THREADS)
        print(
            f"\n## limit {share:g}x = {limit / 1e9:.2f} GB; disk roof {roof:.2f} GB/s "
            f"(O_DIRECT random {READ_PIECE >> 20} MiB reads, {IO_THREADS} in flight, cold; measured again after the "
            f"limit's runs)",
            flush=True,
        )
        first_row = len(result["rows"])
        for engine in engines:
            for kind in ["short"] + (["long"] if long else []):
                if kind == "long" and "failed" in result["rows"][-1]:  # what killed the short run kills this
                    result["rows"].append(
                        {
                            "share": share,
                            "limit": limit,
                            "roof_gbps": roof,
                            "engine": engine,
                            "run": kind,
                            "failed": "not run: the short run failed",
                        }
                    )
                    print(describe(result["rows"][-1]), flush=True)
                    continue
                gen = a.gen_tokens if kind == "short" else 2
                if engine.startswith("llama") and share < 1 and kind == "short":
                    gen = min(gen, a.llama_gen_tokens)
                if engine == "flashmoe":
                    spec = {
                        "engine": "flashmoe",
                        "path": str(fm),
                        "prompt": short if kind == "short" else long,
                        "gen": gen,
                        "load": json.loads(a.flashmoe_load),
                        "store": json.loads(a.flashmoe_store),
                    }
                else:
                    spec = {
                        "engine": "llama.cpp",
                        "path": str(gguf),
                        "ids": ids[kind],
                        "gen": gen,
                        "threads": a.threads,
                        "repack": engine.endswith("repack"),
                    }
                n += 1
                out = run_child(spec, limit, a.timeout, f"flashmoe-btr-{os.getpid()}-{n}")
                row = {"share": share, "limit": limit, "roof_gbps": roof, "engine": engine, "run": kind, **out}
                if "decode_tps" in out and out.get("device_bytes_per_token"):
                    tps = out.get("steady_tps", out["decode_tps"])
                    dev = out.get("steady_device_bytes_per_token", out["device_bytes_per_token"])
                    row["roof_fraction"] = tps * dev / (roof * 1e9)
                    row["roof_tps"] = roof * 1e9 / dev if dev else None
                result["rows"].append(row)
                print(describe(row), flush=True)
        # The drive (a virtual disk here) varies from minute to minute: the roof is the mean of
        # a measurement before and one after the limit's runs, and both are kept.
        after = disk_roof(files, READ_PIECE, IO_THREADS)
        print(f"# disk roof after: {after:.2f} GB/s", flush=True)
        for row in result["rows"][first_row:]:
            row["roof_before_gbps"], row["roof_after_gbps"] = roof, after
            row["roof_gbps"] = (roof + after) / 2
            if row.get("roof_tps"):
                dev = row.get("steady_device_bytes_per_token", row.get("device_bytes_per_token"))
                row["roof_tps"] = row["roof_gbps"] * 1e9 / dev
                row["roof_fraction"] = row.get("steady_tps", row.get("decode_tps")) / row["roof_tps"]
    if a.serve_limit:  # serve under a stream of requests, with its defaults, at one limit
        limit = int(size * a.serve_limit)
        words = prompt_of(tok, 600).split()
        prompts = [" ".join(words[: 40 * (1 + i % 8)]) + f" (request {i})" for i in range(a.serve_requests)]
        out = serve_stream(fm, limit, prompts, a.timeout, f"flashmoe-btr-{os.getpid()}-serve")
        out.update(share=a.serve_limit, limit=limit)
        result["serve"] = out
        ok = sum(1 for x in out["statuses"] if x == 200)
        print(
            f"\n## serve at {a.serve_limit:g}x = {limit / 1e9:.2f} GB: {ok}/{out['requests']} replies 200, "
            f"{'alive' if out['alive_at_end'] else 'DEAD (exit ' + str(out['exit']) + ')'} at the end, "
            f"OOM kills {out['oom_kills']}, peak {fmt(out['peak_bytes'])}, {out['wall_s']:.0f} s",
            flush=True,
        )
    if a.out:
        tmp = a.out.with_name(a.out.name + ".partial")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, a.out)
    print("\n" + table(result), flush=True)
    return 0


def describe(r: dict) -> str:
    head = f"{r['engine']:<17} {r['run']:<5}"
    if "failed" in r:
        return f"{head} FAILED: {r['failed']} (peak {fmt(r.get('peak_bytes'))})"
    bits = [f"prefill {r['prompt_tokens']} tok {r['prefill_tps']:.2f} tok/s"]
    if r["run"] == "short":
        bits.append(
            f"decode {r.get('decode_tps', 0):.2f} tok/s (first {FIRST}: {r.get('first16_tps', 0):.2f}, "
            f"then {r.get('steady_tps', 0):.2f})"
        )
        bits.append(f"device {fmt(r.get('steady_device_bytes_per_token', r.get('device_bytes_per_token')))}/token")
        if r.get("roof_fraction") is not None:
            bits.append(f"roof {r['roof_tps']:.2f} tok/s, {r['roof_fraction']:.0%} of it")
        if r.get("steady_overlap") is not None:
            bits.append(f"overlap {r['steady_overlap']:.0%}")
        if r.get("hit_rate") is not None:
            bits.append(f"hit {r['hit_rate']:.0%}")
        bits.append(f"majflt {r.get('major_faults_per_token', 0):.0f}/token")
    if r.get("expert_cache_bytes"):
        bits.append(f"expert cache {fmt(r['expert_cache_bytes'])}, ctx {r.get('context')}")
    bits.append(f"peak {fmt(r.get('peak_bytes'))}")
    return f"{head} " + " | ".join(bits)


def fmt(n) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def why_not(run: dict) -> str:
    """A table cell for a run with no figures."""
    failed = run.get("failed", "")
    return (
        "-"
        if not run
        else "killed (OOM)"
        if "OOM" in failed
        else "timed out"
        if "timed out" in failed
        else "not run"
        if "not run" in failed
        else "failed"
    )


def table(result: dict) -> str:
    """The sitting as one markdown table: a row per limit and engine."""

    def pct(x):
        return "-" if x is None else f"{x:.0%}"

    out = [
        "| limit | engine | decode tok/s | first 16 / steady | device MB/token | roof fraction | overlap | hit "
        "| prefill 34 tok/s | prefill 1k tok/s | peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = result["rows"]
    for share in dict.fromkeys(r["share"] for r in rows):
        for engine in dict.fromkeys(r["engine"] for r in rows):
            got = {r["run"]: r for r in rows if r["share"] == share and r["engine"] == engine}
            s, lo = got.get("short", {}), got.get("long", {})
            limit = fmt((s or lo).get("limit"))
            if "failed" in s or not s:
                long_tps = f"{lo['prefill_tps']:.2f}" if "prefill_tps" in lo else why_not(lo)
                out.append(
                    f"| {share:g}x ({limit}) | {engine} | {why_not(s)} | | | | | | | "
                    f"{long_tps} | {fmt(lo.get('peak_bytes'))} |"
                )
                continue
            dev = s.get("steady_device_bytes_per_token", s.get("device_bytes_per_token")) or 0
            out.append(
                f"| {share:g}x ({limit}) | {engine} | {s.get('decode_tps', 0):.2f} | "
                f"{s.get('first16_tps', 0):.2f} / {s.get('steady_tps', 0):.2f} | {dev / 1e6:.0f} | "
                f"{pct(s.get('roof_fraction'))} | {pct(s.get('steady_overlap'))} | {pct(s.get('hit_rate'))} | "
                f"{s.get('prefill_tps', 0):.2f} | "
                + (f"{lo['prefill_tps']:.2f}" if "prefill_tps" in lo else why_not(lo))
                + f" | {fmt(max(x for x in (s.get('peak_bytes'), lo.get('peak_bytes'), 0) if x is not None))} |"
            )
    roof = result.get("compute_roof", {})
    if "steady_tps" in roof:
        out.append(
            f"\nCompute roof (flashmoe, every expert cached after {WARMUP} tokens, hit "
            f"{roof.get('hit_rate', 0):.1%}, no limit): {roof['steady_tps']:.2f} tok/s. Roof fraction: "
            "steady tok/s x device bytes per token / the disk's GB/s (the mean of a measurement before "
            "and after the limit's runs)."
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
