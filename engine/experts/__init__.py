"""Expert streaming: which modules are expert blocks (blocks), the packed layout and its
manifest (layout), the byte-budgeted expert store (store) and the streamed block (switch)."""
