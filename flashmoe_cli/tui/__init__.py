"""The full-screen chat app (`flashmoe chat` on a terminal), built with Textual.

Only this package imports textual; the engine and the other front ends never do.
Layout: app.py (the App: the engine, quitting, the keys that work on every screen), app.tcss
(styles), screens/ (chat: the conversation, the default screen; help and tool-approval modals),
reply.py (a reply's state and figures, and the worker of a plain one), agent_turn.py (a --tools
reply through the AgentLoop, and its approver), slash.py (the slash commands), messages.py (what
the worker threads post), widgets/ (transcript, prompt, status bar, key hints, layer panel, tool
blocks), palette.py (Ctrl+P commands).
"""
