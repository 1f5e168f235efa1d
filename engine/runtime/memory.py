"""How much memory this process may use, read from where the limits really are, and how it is
shared out between the resident weights, the KV cache, the kernels, the prompt caches and the
expert cache.

A container's `--memory`, a systemd slice or a CI runner's cgroup limits the process, not the
RAM the machine has: reading the RAM alone gave a 6 GB expert cache inside a 4 GB cgroup, and the
kernel killed the process without a word. So the figure is the smallest of what each limit
leaves: every cgroup on the process's own path (v2 `memory.max` and `memory.high`, v1
`memory.limit_in_bytes`, less what the group already uses that cannot be reclaimed: its usage
less its inactive file pages), `MemAvailable`, and `RLIMIT_AS` / `RLIMIT_DATA` less what the
process has mapped. `read_limit(root)` reads the files under `root`, so a test points it at a
fake tree; nothing here needs root.

`plan()` is the one place that decides the shares (DESIGN.md section 10). The loader calls it
before any large allocation, `flashmoe info` prints it, and the store is held to it.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

SYS_ROOT = Path("/")
UNLIMITED = 1 << 62  # cgroup v1 writes 9223372036854771712 for "no limit"
MIB = 1 << 20

# What the process takes beyond its weights, caches and activations: numba's compiled kernels,
# MLX's and numpy's allocators, thread stacks, the tokenizer (measured: 150-250 MB on the demo and
# the synthetic model after the first generation, on top of the resident weights and the RSS at
# import). The margin under the limit is a share of it, so the kernel's own reclaim has room.
WORKING_BASE = 256 * MIB
MARGIN_SHARE = 0.04
MARGIN_MIN = 128 * MIB
# The default context, when the model's own would take more than this share of what is left
# after the resident weights: the largest multiple of CONTEXT_STEP that fits it.
CONTEXT_SHARE = 0.25
CONTEXT_STEP = 1024
CONTEXT_MIN = 2048
# The server's in-memory prompt caches (`--prompt-cache`): at most this share of what is left
# after the resident weights and the KV cache, and never more than asked for (2 GB by default).
PROMPT_CACHE_SHARE = 0.25


@dataclass(frozen=True)
class Limit:
    """What the process may still take, and from which limit that figure comes."""

    available: int  # bytes this process may add to what it uses now
    source: str  # one line: the limit that decides, e.g. "cgroup v1 /x: limit 4.00 GB, 1.02 GB in use"
    total: int | None = None  # the deciding limit itself (None: MemAvailable, which has no total)
    others: tuple[str, ...] = ()  # the other limits read, for `flashmoe info`


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _number(path: Path) -> int | None:
    """A cgroup file's single value; None for "max", absent or unreadable files and v1's
    "no limit" (a number close to 2**63)."""
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def _stat(path: Path, *keys: str) -> int:
    """The first of `keys` found in a memory.stat file (0 when none is)."""
    text = _read(path) or ""
    found = dict(line.split(None, 1) for line in text.splitlines() if len(line.split()) == 2)
    for k in keys:
        if k in found and found[k].strip().isdigit():
            return int(found[k])
    return 0


def _mounts(root: Path) -> list[tuple[str, str, str, str]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount (/proc/self/mountinfo)."""
    out = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((tail[0], fields[3], fields[4], tail[2]))
    return out


def _groups(root: Path) -> list[tuple[str, Path, Path]]:
    """(version, the process's own memory cgroup folder, the mount point above it) for v1 and v2."""
    paths = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    out = []
    for fstype, mroot, mpoint, opts in _mounts(root):
        version = "v2" if fstype == "cgroup2" else "v1"
        if version not in paths or (version == "v1" and "memory" not in opts.split(",")):
            continue
        own = paths[version]
        # The path is the group's in the hierarchy; the mount shows it from `mroot` down (a
        # container without a cgroup namespace mounts its own group as the root).
        rel = os.path.relpath(own, mroot) if own.startswith(mroot) else own.lstrip("/")
        rel = "" if rel == "." else rel
        point = root / mpoint.lstrip("/")
        out.append((version, point / rel if rel else point, point))
        del paths[version]
    return out


def _cgroup_limits(root: Path) -> list[tuple[int, int, str]]:
    """(available, limit, text) for each cgroup on the process's path that has a limit."""
    out = []
    for version, folder, top in _groups(root):
        d = folder
        while True:
            if version == "v2":
                limit = min(
                    (v for v in (_number(d / "memory.max"), _number(d / "memory.high")) if v is not None), default=None
                )
                usage = _number(d / "memory.current")
                reclaimable = _stat(d / "memory.stat", "inactive_file")
            else:
                limit = _number(d / "memory.limit_in_bytes")
                usage = _number(d / "memory.usage_in_bytes")
                reclaimable = _stat(d / "memory.stat", "total_inactive_file", "inactive_file")
            if limit is not None:
                used = max(0, (usage or 0) - reclaimable)
                where = "/" + str(d.relative_to(top)) if d != top else "/"
                out.append(
                    (max(0, limit - used), limit, f"cgroup {version} {where}: limit {_gb(limit)}, {_gb(used)} in use")
                )
            if d == top or top not in d.parents:
                break
            d = d.parent
    return out


def _meminfo(root: Path) -> dict[str, int]:
    out = {}
    for line in (_read(root / "proc/meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        bits = rest.split()
        if bits and bits[0].isdigit():
            out[name] = int(bits[0]) * (1024 if len(bits) > 1 and bits[1] == "kB" else 1)
    return out


def _kb_fields(path: Path) -> dict[str, int]:
    out = {}
    for line in (_read(path) or "").splitlines():
        name, _, rest = line.partition(":")
        bits = rest.split()
        if len(bits) == 2 and bits[0].isdigit() and bits[1] == "kB":
            out[name] = int(bits[0]) * 1024
    return out


def _rlimits() -> dict[str, int | None]:
    out = {}
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        soft = resource.getrlimit(getattr(resource, name))[0] if hasattr(resource, name) else resource.RLIM_INFINITY
        out[name] = None if soft == resource.RLIM_INFINITY else soft
    return out


def read_limit(root: Path | None = None, rlimits: dict[str, int | None] | None = None) -> Limit:
    """What this process may still take: the smallest of what each limit leaves. `root` and
    `rlimits` stand in for / and getrlimit in tests."""
    root = SYS_ROOT if root is None else Path(root)
    rlimits = _rlimits() if rlimits is None else rlimits
    found = list(_cgroup_limits(root))
    mem = _meminfo(root)
    if "MemAvailable" in mem:
        found.append((mem["MemAvailable"], None, f"MemAvailable {_gb(mem['MemAvailable'])}"))
    status = _kb_fields(root / "proc/self/status")
    for name, counted in (("RLIMIT_AS", "VmSize"), ("RLIMIT_DATA", "VmData")):
        lim = rlimits.get(name)
        if lim is not None:
            used = status.get(counted, 0)
            found.append((max(0, lim - used), lim, f"{name} {_gb(lim)}, {_gb(used)} mapped"))
    if not found:  # no /proc (macOS): physical memory is all there is to read
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            ram = 8 << 30
        found.append((ram // 2, ram, f"half the physical memory ({_gb(ram)}; no limit readable here)"))
    found.sort(key=lambda f: f[0])
    best = found[0]
    return Limit(best[0], best[2], best[1], tuple(f[2] for f in found[1:]))


# -- what a model needs -----------------------------------------------------------------------


def kv_bytes_per_token(c: dict, dtype_bytes: int = 4, context: int | None = None) -> int:
    """The KV cache's bytes per token of context, from the (text) config `c`: every attention
    layer's keys and values (MLA's one latent and rope key; a sliding window's layers only up to
    the window, counted against `context`). Layers of linear attention keep a fixed state."""
    layers = int(c.get("num_hidden_layers") or 0)
    heads = int(c.get("num_attention_heads") or 1)
    if c.get("kv_lora_rank"):
        per = int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0)
    else:
        kv = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or (int(c.get("hidden_size") or 0) // heads))
        v_dim = int(c.get("v_head_dim") or head_dim)
        per = kv * (head_dim + v_dim)
    types = c.get("layer_types")
    interval = c.get("full_attention_interval")
    window = c.get("sliding_window")
    if isinstance(types, list) and types:
        full = sum(1 for t in types if "linear" not in str(t) and "sliding" not in str(t) and "mamba" not in str(t))
        sliding = sum(1 for t in types if "sliding" in str(t))
    elif isinstance(interval, int) and interval > 0:
        full, sliding = layers // interval, 0
    else:
        full, sliding = layers, 0
    share = 1.0
    if sliding and window and context:
        share = min(1.0, int(window) / max(1, context))
    return int(per * dtype_bytes * (full + sliding * share))


def working_bytes(c: dict, k: int, prefill_step: int, io_threads: int, expert_bytes: int) -> int:
    """The kernels' working set for the (text) config `c` routing to `k` experts: a prefill
    chunk's activations (a dozen hidden-state buffers and the experts' gate and up rows for every
    routed token), the logits, the readers' staging buffers, and WORKING_BASE."""
    hidden = int(c.get("hidden_size") or 0)
    inter = int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
    k = max(1, k)
    rows = prefill_step * (12 * hidden + 3 * k * inter) * 4
    logits = int(c.get("vocab_size") or 0) * 4 * 2
    return WORKING_BASE + rows + logits + io_threads * expert_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """The shares of what the process may use (all bytes). `expert_cache` is what the slots get."""

    limit: Limit
    resident: int
    working: int
    context: int
    kv_per_token: int
    prompt_caches: int
    margin: int
    expert_cache: int
    all_experts: int
    asked_cache: int | None = None  # --expert-cache, when given
    asked_context: int | None = None  # --ctx-size, when given
    model_context: int | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def kv(self) -> int:
        return self.context * self.kv_per_token

    @property
    def fits(self) -> int:
        """The expert cache the budget leaves (what the default takes)."""
        return self.limit.available - self.resident - self.working - self.kv - self.prompt_caches - self.margin

    def lines(self) -> list[tuple[str, str]]:
        """(title, text) rows for `flashmoe info` and the load line."""
        cache = f"{_gb(self.expert_cache)} of {_gb(self.all_experts)} of experts" + (
            " (--expert-cache)" if self.asked_cache is not None else " (what the budget leaves)"
        )
        ctx = f"{self.context} tokens" + (
            " (--ctx-size)"
            if self.asked_context is not None
            else f" (of the model's {self.model_context})"
            if self.model_context
            else ""
        )
        rows = [
            ("memory limit", self.limit.source),
            (
                "memory budget",
                f"{_gb(self.limit.available)} available: resident weights {_gb(self.resident)}, "
                f"kernels {_gb(self.working)}, KV cache {_gb(self.kv)} at {ctx}, "
                + (f"prompt caches {_gb(self.prompt_caches)}, " if self.prompt_caches else "")
                + f"margin {_gb(self.margin)}",
            ),
            ("expert cache", cache),
        ]
        rows += [("", n) for n in self.notes]
        return rows


class MemoryTooSmall(Exception):
    """The resident part of the model does not fit in what the process may use."""


def plan(
    limit: Limit,
    *,
    resident: int,
    working: int,
    kv_per_token: int,
    model_context: int | None,
    all_experts: int,
    min_experts: int,
    ctx_size: int | None = None,
    prompt_cache: int = 0,
    expert_cache: int | None = None,
) -> MemoryPlan:
    """Share `limit.available` out. The default expert cache is what is left after the resident
    weights, the kernels' working set, the KV cache at the context, the prompt caches and the
    margin, at most every expert. Raises MemoryTooSmall (its message is the one line a user sees)
    when even the smallest cache (`min_experts` bytes: one token's experts) and a CONTEXT_MIN
    context do not fit. `prompt_cache`: the server's in-memory prompt caches asked for (0: none)."""
    avail = limit.available
    total = limit.total or avail
    margin = max(MARGIN_MIN, int(total * MARGIN_SHARE))
    fixed = resident + working + margin
    notes = []
    model_ctx = model_context or 4096
    room = max(0, avail - fixed - min_experts)
    if ctx_size is not None:
        context = ctx_size
    elif model_ctx * kv_per_token + all_experts <= room:  # room for everything
        context = model_ctx
    else:  # the KV cache takes at most CONTEXT_SHARE of the room, the experts the rest
        fit = int(room * CONTEXT_SHARE) // max(1, kv_per_token)
        context = (
            model_ctx if fit >= model_ctx else max(min(CONTEXT_MIN, model_ctx), fit // CONTEXT_STEP * CONTEXT_STEP)
        )
        if context < model_ctx:
            notes.append(
                f"context {context} of the model's {model_ctx} tokens: its KV cache would take more than "
                f"{CONTEXT_SHARE:.0%} of the memory left (--ctx-size sets it)"
            )
    least = context if ctx_size is not None else min(context, CONTEXT_MIN)
    need = fixed + least * kv_per_token + min_experts
    if need > avail:
        raise MemoryTooSmall(
            f"needs at least {_gb(need)} more memory (resident weights {_gb(resident)}, kernels "
            f"{_gb(working)}, KV cache {_gb(least * kv_per_token)} at {least} tokens, one token's "
            f"experts {_gb(min_experts)}, margin {_gb(margin)}) but this process may take "
            f"{_gb(avail)} more ({limit.source})"
        )
    left = avail - fixed - context * kv_per_token
    prompt = 0
    if prompt_cache:
        prompt = min(prompt_cache, max(0, int((left - min_experts) * PROMPT_CACHE_SHARE)))
        if prompt < prompt_cache:
            notes.append(f"prompt caches {_gb(prompt)} of the {_gb(prompt_cache)} asked: the budget leaves no more")
    fits = max(0, left - prompt)
    if expert_cache is None:
        cache = min(all_experts, max(min_experts, fits))
    else:
        cache = expert_cache
        if expert_cache > max(fits, min_experts):
            notes.append(
                f"--expert-cache {_gb(expert_cache)} is more than the {_gb(max(0, fits))} the memory "
                f"budget leaves ({limit.source})"
            )
    return MemoryPlan(
        limit,
        resident,
        working,
        context,
        kv_per_token,
        prompt,
        margin,
        cache,
        all_experts,
        expert_cache,
        ctx_size,
        model_context,
        tuple(notes),
    )


def _gb(n: int | float) -> str:
    n = float(n)
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.0f} MB"
