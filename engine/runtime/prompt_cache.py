"""Prompt caches shared by requests that carry no conversation of their own (the server's).

An API client resends the whole history every turn. The pool keeps the KV / recurrent caches
of several recent prompts (LRU, under a byte budget) and gives each new request the one that
shares the longest token prefix with it, so turn N runs only its new tokens.

Caches are kept apart by tenant (a server's API key and --tenant-header): a request is given
only a cache its own tenant's prompts left, in memory or on disk, so what another client's
prompt holds never shows in its `cached_tokens` or its prefill time (issue 41).

A cache that is reused is never trimmed in place when it holds more than the new request
shares: the CPU fast path writes keys and values into the cache's buffers in place, so two
requests must not share buffers. The shared part is copied instead, and the longer cache stays
for the conversation it came from.
"""

from __future__ import annotations

import errno
import math
import os

from flashmoe.engine.runtime.generate import Session


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cache_bytes(session: Session) -> int:
    if session.cache is None:
        return 0
    return sum(int(getattr(c, "nbytes", 0) or 0) for c in session.cache)


def _copy_cache(cache: list, keep: int | None = None):
    """An independent copy of a prompt cache (mlx-lm's cache objects), buffers included. With
    `keep`, a cache of plain KV caches only is copied only as far as its first `keep` positions
    (rounded up to the allocation step) and ends there, as a trim would leave it: a hit on a long
    conversation's cache for the system prompt a new session shares copies the prefix, not the
    conversation."""
    import copy

    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models.cache import KVCache

    cut = keep is not None and all(type(c) is KVCache and c.keys is not None and c.offset >= keep for c in cache)
    out = []
    for c in cache:
        new = copy.copy(c)
        if cut:
            rows = min(c.keys.shape[2], -(-keep // c.step) * c.step)
            new.state = (c.keys[..., :rows, :] + 0, c.values[..., :rows, :] + 0, keep)
        elif c.state is not None:
            new.state = tree_map(lambda x: x + 0 if isinstance(x, mx.array) else x, c.state)
        out.append(new)
    mx.eval([c.state for c in out if c.state is not None])
    return out


class PromptCachePool:
    """Sessions for prompts, picked by longest shared prefix; least recently used go first."""

    def __init__(self, loaded, budget_bytes: int = 2 << 30, max_entries: int = 16, disk=None):
        """disk: a DiskPromptCache the pool falls back on and saves to (None: memory only)."""
        self.loaded = loaded
        self.disk = disk
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.entries: list[Session] = []  # least recently used first

    def pick(self, ids: list[int], tenant: str = "") -> Session:
        """The session for a prompt of these ids: a cached one of the same tenant that `ids`
        continues, a copy of the one that shares most with them, or a new one."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        if self.budget_bytes <= 0:  # no pool: every prompt runs whole
            return Session(self.loaded, tenant)
        best, shared = None, 0
        for s in self.entries:
            if s.tenant != tenant:
                continue
            n = common_prefix(s.tokens, ids)
            usable = n == len(s.tokens) or (s.cache is not None and can_trim_prompt_cache(s.cache))
            if usable and n > shared:
                best, shared = s, n
        if self.disk is not None:
            saved = self.saved(ids, more_than=shared, tenant=tenant)
            if saved is not None:
                best, shared = saved, common_prefix(saved.tokens, ids)
                self.entries.append(saved)
        if best is None:
            session = Session(self.loaded, tenant)
        elif shared == len(best.tokens) and shared < len(ids):
            self.entries.remove(best)  # this prompt continues it: it moves on with it
            session = best
        else:
            session = Session(self.loaded, tenant)
            session.cache, session.tokens = _copy_cache(best.cache, keep=shared), list(best.tokens)
            if all(getattr(c, "offset", None) == shared for c in session.cache):
                session.tokens = session.tokens[:shared]
        self.entries.append(session)
        self._evict(keep=session)
        return session

    def saved(self, ids: list[int], more_than: int = 0, tenant: str = "") -> Session | None:
        """The tenant's saved session that shares the longest prefix with `ids` (more than
        `more_than` tokens), loaded, if its cache can be cut back to what it shares; else None."""
        from mlx_lm.models.cache import can_trim_prompt_cache

        file, n = self.disk.best(ids, tenant)
        if n <= more_than:
            return None
        session = self.disk.load(file, self.loaded, tenant)
        if session is None or not (n == len(session.tokens) or can_trim_prompt_cache(session.cache)):
            return None
        return session

    def save(self, session: Session) -> None:
        """Save a session's cache to disk, best effort: a full or read-only disk, a removed kv/
        folder (OSError, or MLX's RuntimeError) costs the cache, never the reply or the engine."""
        try:
            self.disk.save(session)
        except Exception as e:  # noqa: BLE001
            import logging

            logging.getLogger("flashmoe").warning(
                "flashmoe: warning: prompt cache not saved: %s", str(e).splitlines()[0] if str(e) else type(e).__name__
            )

    def _evict(self, keep: Session) -> None:
        while len(self.entries) > self.max_entries or (
            len(self.entries) > 1 and sum(cache_bytes(s) for s in self.entries) > self.budget_bytes
        ):
            victim = next(s for s in self.entries if s is not keep)
            self.entries.remove(victim)

    def settle(self) -> None:
        """After a generation: the budget holds with the new cache's size, and the cache is saved."""
        if self.entries:
            self._evict(keep=self.entries[-1])
            if self.disk is not None:
                self.save(self.entries[-1])

    def drop(self, session: Session) -> None:
        if session in self.entries:
            self.entries.remove(session)

    def clear(self) -> None:
        self.entries = []


# -- on disk ---------------------------------------------------------------------------------


def model_identity(path) -> str:
    """What a saved cache must have been computed by: the config and the weight and tokenizer
    files (names, sizes and times), hashed. A cache from any other model is refused. The expert
    usage file, rewritten by every run (experts/usage.py), is not the model: left out."""
    import hashlib
    from pathlib import Path

    from flashmoe.engine.experts.usage import FILE as USAGE_FILE

    folder = Path(path)
    h = hashlib.sha256()
    h.update((folder / "config.json").read_bytes() if (folder / "config.json").is_file() else b"")
    for f in sorted(folder.rglob("*")):
        if (
            f.is_file()
            and f.suffix in (".safetensors", ".bin", ".json", ".gguf")
            and f.name not in ("config.json", USAGE_FILE)
        ):
            st = f.stat()
            h.update(f"{f.relative_to(folder)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


class Damaged(Exception):
    """A file in kv/ that is not a prompt cache this code wrote; the message says why."""


MAX_HEADER_BYTES = 64 << 20
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}


def read_header(file) -> dict:
    """The safetensors header of a saved cache, checked before any of it is used: a regular file
    (not a FIFO, a device or a symlink), a header that fits the file and is a JSON object of at
    most MAX_HEADER_BYTES, string metadata, and every tensor's dtype, shape and data offsets inside
    the file. Raises Damaged."""
    import json
    import stat
    import struct

    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise Damaged("a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Damaged("not a regular file")
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            raise Damaged("too short to be a saved cache")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > st.st_size:
            raise Damaged(f"its header claims {n:,} bytes, past the end of the file or its limit")
        raw = b""
        while len(raw) < n:
            chunk = os.pread(fd, n - len(raw), 8 + len(raw))
            if not chunk:
                raise Damaged("it ends inside its header")
            raw += chunk
    finally:
        os.close(fd)
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else e
        raise Damaged(f"its header is not JSON ({why})") from None
    if not isinstance(header, dict):
        raise Damaged("its header is not a JSON object")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise Damaged("its metadata is not a table of strings")
    data_bytes = st.st_size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") in _DTYPE_BYTES
            and isinstance(entry.get("shape"), list)
            and all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 40 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])
        )
        if not ok:
            raise Damaged(f"its tensor {name[:40]!r} is not described as safetensors describes one")
        begin, end = entry["data_offsets"]
        size = math.prod(entry["shape"]) * _DTYPE_BYTES[entry["dtype"]]
        if not 0 <= begin <= end <= data_bytes or end - begin != size:
            raise Damaged(f"its tensor {name[:40]!r} lies outside the file or does not match its shape")
    return header


def _metadata(header: dict) -> dict:
    """The user metadata of a saved cache (mlx-lm's save_prompt_cache keeps it under "0.")."""
    return {k[2:]: v for k, v in header.get("__metadata__", {}).items() if k.startswith("0.")}


def _tokens(meta: dict) -> list[int]:
    try:
        tokens = [int(t) for t in meta.get("tokens", "").split(",") if t]
    except ValueError:
        raise Damaged("its token list is not numbers") from None
    if any(t < 0 for t in tokens):
        raise Damaged("its token list is not numbers")
    return tokens


class DiskPromptCache:
    """Prompt caches saved under `folder` (FLASHMOE_HOME/kv/), one safetensors file each (mlx-lm's
    save_prompt_cache), with the model's identity and the token ids in its metadata. Written
    private (0600 in a 0700 folder) to a fresh temporary name, created exclusively and never
    through a symlink, then renamed; checked on load (read_header, the model, and that the cache
    holds as many positions as it has tokens); a file that is not a cache we wrote is skipped and
    deleted with one line; the oldest go when the folder passes `cap_bytes`."""

    MIN_TOKENS = 16  # shorter prompts are cheaper to run again than to read back

    def __init__(self, folder, model_path, cap_bytes: int = 8 << 30, kv_cache: str = "float32"):
        from pathlib import Path

        self.folder = Path(folder)
        self.model = model_identity(model_path)
        self.kv_cache = kv_cache  # (--kv-cache: a float16 run's caches and a float32 run's are kept apart)
        self.cap_bytes = cap_bytes
        self.refused: list[str] = []  # files not used, and why (for logs and tests)
        self.index: dict = {}  # file -> token ids, this model's only
        self.owner: dict = {}  # file -> its tenant ("": local conversations, or a server's only one)
        self.folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # (FLASHMOE_HOME, if this makes it)
        self.folder.mkdir(mode=0o700, exist_ok=True)
        _private(self.folder, 0o700)
        for f in sorted(self.folder.glob("*.safetensors")):
            if ".partial" in f.name:
                _remove_stale(f)
                continue
            try:
                meta = _metadata(read_header(f))
                if meta.get("model") != self.model or meta.get("kv_cache", "float32") != self.kv_cache:
                    continue  # another model's (or KV cache's): load() refuses it if asked
                self.index[f] = _tokens(meta)
                self.owner[f] = meta.get("tenant", "")
            except Damaged as e:
                self._discard(f, str(e))

    def _discard(self, file, why: str) -> None:
        """Skip a damaged or planted file with one line, and delete it (a folder is left as it is:
        it was not written by us)."""
        import logging

        try:
            file.unlink()
            what = "deleted"
        except IsADirectoryError:
            what = "left where it is"
        except OSError as e:
            what = f"could not be deleted ({e.strerror or e})"
        self.index.pop(file, None)
        self.owner.pop(file, None)
        self.refused.append(f"{file.name}: {why}")
        logging.getLogger("flashmoe").warning("flashmoe: warning: prompt cache %s: %s; skipped and %s", file, why, what)

    def best(self, ids: list[int], tenant: str = "") -> tuple[object, int]:
        """(file, shared tokens) of the tenant's saved cache that shares the longest prefix with
        `ids` (the pool trims what it holds past that); (None, 0) when none shares MIN_TOKENS."""
        best, shared = None, self.MIN_TOKENS - 1
        for f, tokens in self.index.items():
            if self.owner.get(f, "") != tenant:
                continue
            n = common_prefix(tokens, ids)
            if n > shared:
                best, shared = f, n
        return (best, shared) if best is not None else (None, 0)

    def load(self, file, loaded, tenant: str = "") -> Session | None:
        """The saved session, or None (said in `refused`) when it is not this model's or this
        tenant's, or is damaged (then deleted)."""
        from mlx_lm.models.cache import load_prompt_cache

        try:
            read_header(file)  # before MLX reads a byte of it
            cache, meta = load_prompt_cache(str(file), return_metadata=True)
            tokens = _tokens(meta)
        except Damaged as e:
            self._discard(file, str(e))
            return None
        except Exception as e:  # noqa: BLE001  (a damaged file is refused, never fatal)
            self._discard(file, f"unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
            return None
        if meta.get("model") != self.model:
            self.refused.append(f"{file.name}: written by another model")
            return None
        if meta.get("tenant", "") != tenant:
            self.refused.append(f"{file.name}: another tenant's")
            return None
        kv, want = meta.get("kv_cache", "float32"), self.kv_cache
        if kv != want:  # (its rows would be read as they are, the other way than this run asks)
            self.refused.append(f"{file.name}: its KV cache is {kv}, this run keeps {want}")
            return None
        from mlx_lm.models.cache import make_prompt_cache

        offsets = {getattr(c, "offset", len(tokens)) for c in cache}
        fresh = make_prompt_cache(loaded.model)
        if [type(c) for c in cache] != [type(c) for c in fresh] or offsets - {len(tokens)}:
            self._discard(file, "its cache does not match its tokens or this model")
            return None
        session = Session(loaded, tenant)
        session.cache, session.tokens = cache, tokens
        return session

    def save(self, session: Session) -> None:
        import hashlib
        import secrets

        from mlx_lm.models.cache import save_prompt_cache

        tokens = list(session.tokens)
        if len(tokens) < self.MIN_TOKENS or session.cache is None:
            return
        kv = "" if self.kv_cache == "float32" else f":{self.kv_cache}"  # (float32: the names files had before)
        tenant = getattr(session, "tenant", "")
        key = hashlib.sha256(f"{self.model}{kv}{':' + tenant if tenant else ''}:{tokens}".encode()).hexdigest()[:32]
        final = self.folder / f"{key}.safetensors"
        # A name no one could have planted a symlink at, created here or not at all (O_EXCL and
        # O_NOFOLLOW), written through this descriptor: never through a link to another file.
        tmp = self.folder / f"{key}.{secrets.token_hex(8)}.partial.safetensors"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as out:
                meta = {
                    "model": self.model,
                    "tokens": ",".join(map(str, tokens)),
                    "format": "flashmoe-kv-1",
                    "kv_cache": self.kv_cache,
                }
                if tenant:
                    meta["tenant"] = tenant
                save_prompt_cache(out, session.cache, meta)
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # The turns before this one are prefixes of it: this file serves them too.
        for f, old in list(self.index.items()):
            if f != final and self.owner.get(f, "") == tenant and len(old) <= len(tokens) and old == tokens[: len(old)]:
                f.unlink(missing_ok=True)
                del self.index[f]
                self.owner.pop(f, None)
        self.index[final] = tokens
        self.owner[final] = tenant
        self._trim()

    def _trim(self) -> None:
        files = []
        for f in self.folder.glob("*.safetensors"):
            try:
                files.append((f.lstat().st_mtime, f.lstat().st_size, f))
            except OSError:
                continue
        files.sort()
        total = sum(size for _, size, _ in files)
        for _, size, f in files[:-1]:
            if total <= self.cap_bytes:
                break
            total -= size
            f.unlink(missing_ok=True)
            self.index.pop(f, None)
            self.owner.pop(f, None)


def _remove_stale(partial, age_s: float = 3600.0) -> None:
    """A temporary file a crashed save left (another process's may be being written: an hour)."""
    import time

    try:
        if time.time() - os.lstat(partial).st_mtime > age_s:
            partial.unlink()
    except OSError:
        pass


def _private(path, mode: int) -> None:
    """Take group and other permissions off a file or folder of ours (it may predate this code)."""
    try:
        st = os.lstat(path)
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(path, mode, follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass
