"""The full-screen chat app (`flashmoe chat` on a terminal), built with Textual.

Only this package imports textual; the engine and the other front ends never do.
Layout: app.py (the App: the engine, quitting, the keys that work on every screen), app.tcss
(styles), screens/ (chat: the conversation, the default screen; help and tool-approval modals),
agent_turn.py (a turn through the AgentLoop, the one turn driver of every face, on a thread
worker), messages.py (what the worker threads post), widgets/ (transcript, prompt, status bar,
key hints, layer panel, tool blocks), palette.py (Ctrl+P commands).
"""
