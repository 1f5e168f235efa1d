"""The full-screen chat app (`flashmoe chat` on a terminal), built with Textual.

Only this package imports textual; the engine and the other front ends never do.
Layout: app.py (the App, its keys and the engine plumbing), app.tcss (styles), messages.py
(what the worker threads post), agent_turn.py (a --tools reply through the AgentLoop, and its
approver), widgets/ (transcript, prompt, status bar, key hints, layer panel, tool blocks),
screens/ (help, tool approval), palette.py (Ctrl+P commands).
"""
