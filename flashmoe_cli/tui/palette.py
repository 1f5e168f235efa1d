"""Ctrl+P: the slash commands as command palette entries (the App's, so they are there over any screen)."""

from __future__ import annotations

from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider


class ChatCommands(Provider):
    def _entries(self):
        app = self.app
        chat = app.chat  # type: ignore[attr-defined]  (the ChatApp's chat screen, under the palette or not)
        run = chat.run_slash
        prefill = chat.prefill_prompt
        return [
            ("Help: keys and commands", app.action_help, "F1; /help lists the commands in the chat"),  # type: ignore[attr-defined]
            ("Clear conversation", partial(run, "clear", ""), "/clear: start a new conversation"),
            ("Set system prompt…", partial(prefill, "/system "), "/system TEXT"),
            ("Toggle layer panel", partial(run, "timing", ""), "F2 or /timing"),
            ("Timing: layer", partial(run, "timing", "layer"), "per-layer breakdown from the next reply (adds syncs)"),
            ("Timing: step", partial(run, "timing", "step"), "host-side figures only (default)"),
            ("Timing: off", partial(run, "timing", "off"), "no timings"),
            ("Save conversation…", partial(prefill, "/save "), "/save PATH writes Markdown"),
            ("Exit", partial(run, "exit", ""), "/exit, Ctrl+D on an empty box, Ctrl+C twice"),
        ]

    async def discover(self) -> Hits:
        for name, command, help in self._entries():
            yield DiscoveryHit(name, command, help=help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, command, help in self._entries():
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), command, help=help)
