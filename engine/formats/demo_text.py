"""Real, offline English for fitting and judging the real-routing demo: the standard library's
own documentation, as `pydoc` renders it. Calibration and held-out text come from disjoint
modules, so perplexity on the held-out text measures text the fit never saw.
"""

from __future__ import annotations

import importlib
import pydoc
import re

CALIBRATION_MODULES = ("json", "pathlib", "argparse", "collections", "subprocess", "logging", "itertools", "functools")
HELD_OUT_MODULES = ("csv", "heapq", "textwrap", "shutil", "statistics", "string")


def module_text(name: str) -> str:
    """The plain-text pydoc page of a module, without its machine-dependent FILE section."""
    text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
    text = re.sub(r"\nFILE\n(    .*\n?)+", "\n", text)
    return text


def calibration_text() -> str:
    return "\n\n".join(module_text(m) for m in CALIBRATION_MODULES)


def held_out_text() -> str:
    return "\n\n".join(module_text(m) for m in HELD_OUT_MODULES)
