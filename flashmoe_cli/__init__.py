"""flashmoe's front ends: the command line, and (later) the chat TUI and line REPL."""

__version__ = "0.1.0"
