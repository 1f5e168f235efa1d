"""The chat app's widgets."""

from .hints import KeyHints
from .layer_panel import LayerPanel
from .prompt_input import PromptInput
from .status_bar import StatusBar
from .tool_block import ToolBlock
from .transcript import AssistantMessage, Note, Transcript, UserMessage

__all__ = [
    "AssistantMessage",
    "KeyHints",
    "LayerPanel",
    "Note",
    "PromptInput",
    "StatusBar",
    "ToolBlock",
    "Transcript",
    "UserMessage",
]
