"""The chat app's screens."""
from .help import HelpScreen

__all__ = ["HelpScreen"]
