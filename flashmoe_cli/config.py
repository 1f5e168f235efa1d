"""Settings: defaults < config file < FLASHMOE_* environment < flags the user typed.

The config file is TOML at FLASHMOE_HOME/config.toml (see `flashmoe config path`), with the
same names as the long flags, e.g.

    model = "~/models/qwen3-30b-fm"
    max_tokens = 1024
    temp = 0.7
    expert_cache = "4GB"
"""

from __future__ import annotations

import os
import sys

from flashmoe.engine import options

from .errors import ConfigError
from .paths import config_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The engine's own lists (flashmoe.engine.options imports no MLX), under the names the flags use.
TIMING_CHOICES = options.TIMING_MODES
DTYPE_CHOICES = options.DTYPES
KERNEL_CHOICES = options.KERNELS
KV_CACHE_CHOICES = options.KV_CACHES
PREFETCH_CHOICES = options.PREFETCH_MODES
CACHE_POLICY_CHOICES = options.CACHE_POLICIES
TRUNCATE_CHOICES = options.TRUNCATE_MODES
THINKING_CHOICES = options.THINKING_CHOICES  # unset: the chat template's default

# name -> (default, parser from text: a type, "size", "count" (an integer >= 1), a tuple of words, or
# the name of a range-checked number in argtypes.py, the flag's own type: "temperature", "top_p", ...)
SETTINGS = {
    "model": (None, str),
    "system": (None, str),
    "max_tokens": (512, "count"),
    "temp": (0.0, "temperature"),
    "top_p": (1.0, "top_p"),
    "top_k": (0, int),
    "min_p": (0.0, "min_p"),
    "repetition_penalty": (1.0, "repetition_penalty"),
    "seed": (None, int),
    "timing": ("step", TIMING_CHOICES),
    "expert_cache": (None, "size"),
    "ctx_size": (None, "count"),
    "io_threads": (8, "count"),
    "dtype": ("auto", DTYPE_CHOICES),
    "kernels": ("auto", KERNEL_CHOICES),
    "kv_cache": ("float32", KV_CACHE_CHOICES),
    "prefetch": ("off", PREFETCH_CHOICES),
    "cache_policy": ("lfu", CACHE_POLICY_CHOICES),
    "verify_reads": ("on", ("on", "off")),
    "expert_usage": ("on", ("on", "off")),
    "truncate_prompt": ("off", TRUNCATE_CHOICES),
    "thinking": (None, THINKING_CHOICES),
}


def _parse(name: str, value, where: str):
    kind = SETTINGS[name][1]
    try:
        if isinstance(kind, tuple):  # one of these words
            if value not in kind:
                raise ValueError(f"choose one of {', '.join(kind)}")
            return value
        if kind == "size":
            from .argtypes import parse_size

            return value if isinstance(value, int) else parse_size(str(value))
        if kind in ("temperature", "top_p", "min_p", "repetition_penalty"):
            from . import argtypes

            return getattr(argtypes, kind)(value)
        if kind == "count":
            text = str(value).strip()
            if isinstance(value, bool) or not text.isdigit() or int(text) < 1:
                raise ValueError("a whole number, at least 1")
            return int(text)
        return kind(value)
    except (ValueError, TypeError, Exception) as e:
        raise ConfigError(f"{where}: {name} = {value!r} is not valid ({e})") from None


MAX_CONFIG_BYTES = 1 << 20


def _read_config(path) -> str:
    """The config file's text: a regular file (a FIFO would block the start-up) of sane size."""
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError("not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise OSError(f"{st.st_size:,} bytes; a config file is at most {MAX_CONFIG_BYTES:,}")
        return f.read().decode("utf-8")


def load_settings(explicit: dict) -> dict:
    """Merge the layers; `explicit` holds only the flags the user actually typed."""
    merged = {k: d for k, (d, _) in SETTINGS.items()}
    path = config_file()
    if path.exists():
        try:
            data = tomllib.loads(_read_config(path))
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: {e}") from None
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to read") from None
        for k, v in data.items():
            if k not in SETTINGS:
                raise ConfigError(f"{path}: unknown setting {k!r} (known: {', '.join(SETTINGS)})")
            merged[k] = _parse(k, v, str(path))
    for k in SETTINGS:
        env = os.environ.get("FLASHMOE_" + k.upper())
        if env is not None and env != "":
            if k == "system":  # text: bytes that are not UTF-8 become U+FFFD (utf8.py)
                from .utf8 import decode_text

                env = decode_text(env, "FLASHMOE_SYSTEM")
            merged[k] = _parse(k, env, "FLASHMOE_" + k.upper())
    merged.update(explicit)
    return merged
