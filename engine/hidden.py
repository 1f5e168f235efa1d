"""Hidden: holds a module outside its parent's parameter tree.

A slot bank, an original block kept for its fallback, a kernel's source arrays: none is a weight
of the module that keeps it, so mlx's tree walks (parameters(), update(), load_weights) must not
see them.
"""

from __future__ import annotations


class Hidden:
    def __init__(self, module):
        self.module = module
