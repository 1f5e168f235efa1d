"""The chat app's screens."""
from .approve import ApproveScreen
from .help import HelpScreen

__all__ = ["ApproveScreen", "HelpScreen"]
