"""The chat app's screens: the chat itself (the default screen), and the help and tool-approval modals."""

from .approve import ApproveScreen
from .chat import ChatScreen
from .help import HelpScreen

__all__ = ["ApproveScreen", "ChatScreen", "HelpScreen"]
