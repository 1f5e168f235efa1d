"""Who a request comes from: the API keys `flashmoe serve` takes, and the tenant a request's key
(and `--tenant-header`) makes.

Keys come from `--api-key` (repeatable; visible to every local user in /proc/<pid>/cmdline and
`ps`), `--api-key-file FILE` (one a line; `#` starts a comment) and the FLASHMOE_API_KEY
environment variable (only the user and root read /proc/<pid>/environ). An empty key, or a key
file with none, is refused: it would have served everyone while looking protected.

A tenant is what the prompt caches are kept apart by (engine/runtime/prompt_cache.py): requests
of one tenant reuse each other's caches, and no other tenant's. Each key is a tenant; with
`--tenant-header NAME` the header's value splits a key's requests further (set it in a proxy
that authenticates users: a client that can reach the server directly can claim any value).
Tenants are hashes, never the keys themselves (they are written into saved caches).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat

from ..errors import UsageError

ENV = "FLASHMOE_API_KEY"


def load_keys(flags: list[str] | None, files: list[str] | None, environ=os.environ) -> tuple[str, ...]:
    """Every key the server takes (none: it serves anyone who can reach it). UsageError for an
    empty key, an unreadable file or one with no key in it."""
    keys: list[str] = []
    for key in flags or ():
        if not key.strip():
            raise UsageError("--api-key '': an empty key would let anyone in; give a key, or leave --api-key out")
        keys.append(key.strip())
    env = environ.get(ENV)
    if env is not None:
        if not env.strip():
            raise UsageError(f"{ENV} is set but empty: an empty key would let anyone in; unset it or give a key")
        keys.append(env.strip())
    for name in files or ():
        keys.extend(_read_key_file(name))
    return tuple(dict.fromkeys(keys))


def _read_key_file(name: str) -> list[str]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
                raise OSError("not a regular file of at most 1 MB")
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--api-key-file {name}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise UsageError(f"--api-key-file {name}: holds no key (one a line)")
    if st.st_mode & 0o077:
        import logging

        logging.getLogger("flashmoe").warning(
            "flashmoe: warning: --api-key-file %s can be read by other users (chmod 600 it)", name
        )
    return keys


def matching_key(keys: tuple[str, ...], given: str) -> str | None:
    """The key `given` is, compared in constant time with each."""
    found = None
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            found = key
    return found


def tenant(key: str | None, header: str | None) -> str:
    """The tenant of a request: "" when the server has no keys and no tenant header (one tenant:
    everyone), else a hash of its key and header value."""
    if key is None and header is None:
        return ""
    text = f"key:{key or ''}\nheader:{header if header is not None else ''}"
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:32]
