"""What becomes of each field of a request: honoured, ignored and recorded, translated, or refused.

Coding agents send fields a user cannot switch off (Claude Code's `context_management`, Codex's
`client_metadata`). A field we do not act on is never dropped in silence: a hint that changes
nothing is accepted and recorded (the response's `x-flashmoe-ignored` header and /metrics); a
field whose loss would change the result is refused. One 400 names every problem of a request at
once, so a client learns them in one round. `--strict-fields` refuses the hints too (and the
translations: thinking, mid-conversation system messages, tools of other types), as flashmoe did
before. docs/serve.md has the table per endpoint; each API module names its fields in a Policy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import APIError

_INDEX = re.compile(r"\[\d+\]")
# Hints that appear all over a body (every block of Claude Code's): recorded by their name alone.
EVERYWHERE = ("cache_control",)
HEADER_CHARS = 2000


@dataclass(frozen=True)
class Policy:
    """The top-level fields of one endpoint's body: `honoured` are read (translated ones
    included); `ignored` are hints accepted and recorded. Anything else is refused by name."""

    honoured: frozenset[str]
    ignored: frozenset[str] = frozenset()


@dataclass
class Fields:
    """One request's field record: what was ignored, and every problem that refuses it."""

    strict: bool = False
    ignored: list[str] = field(default_factory=list)
    translated: list[str] = field(default_factory=list)
    problems: list[tuple[str, str | None]] = field(default_factory=list)

    def top(self, body: dict, policy: Policy, where: str = "") -> None:
        """Check the keys of `body` (or of a nested object, named `where`) against a policy."""
        prefix = f"{where}." if where else ""
        for key in body:
            if key in policy.honoured:
                continue
            if key in policy.ignored:
                self.ignore(prefix + key)
            else:
                self.refuse(f"unsupported field {prefix + key!r}: flashmoe serve does not implement it", prefix + key)

    def ignore(self, name: str, why: str = "") -> None:
        """A hint accepted and recorded (refused under --strict-fields). The record names the
        field without list indices (`tools[].eager_input_streaming`), so /metrics counts add up."""
        if self.strict:
            self.refuse(f"unsupported field {name!r}{': ' + why if why else ''} (--strict-fields)", name)
            return
        name = _INDEX.sub("[]", name)
        if name.rsplit(".", 1)[-1] in EVERYWHERE:
            name = name.rsplit(".", 1)[-1]
        if name not in self.ignored:
            self.ignored.append(name)

    def translate(self, name: str, what: str) -> bool:
        """Whether a field may be taken in our own terms (thinking onto the template's switch,
        ...): under --strict-fields it is refused instead and this returns False. Where the
        translation changes the prompt, `record` says what it became."""
        if self.strict:
            self.refuse(f"unsupported field {name!r}: {what} (--strict-fields)", name)
            return False
        return True

    def defer(self, tool: dict, sent: dict, where: str) -> dict:
        """`tool`, marked to stay out of the prompt when the client `sent` it with defer_loading:
        true. Such a tool is loaded only when a tool search finds it (Anthropic's and OpenAI's
        tool search), and this server runs none: offered anyway, a model calls it (Claude Code's
        DeferredToolPlaceholder, "never call this tool"). A tool_choice naming it brings it in
        (generation.py: offered_tools)."""
        if sent.get("defer_loading") is True and self.translate(f"{where}.defer_loading", "a deferred tool"):
            self.record("tools[].defer_loading: left out of the prompt")
            return {**tool, "deferred": True}
        return tool

    def record(self, name: str) -> None:
        """A translation made (the response's x-flashmoe-translated header)."""
        name = _INDEX.sub("[]", name)
        if name not in self.translated:
            self.translated.append(name)

    def refuse(self, message: str, param: str | None = None) -> None:
        self.problems.append((message, param))

    def attempt(self, read, *args, default=None):
        """`read(*args)`; where it refuses the request (a 400), the refusal is one more problem
        and `default` stands in, so the reading goes on and one 400 names every problem."""
        try:
            return read(*args)
        except APIError as e:
            if e.status != 400:
                raise
            self.refuse(e.message, e.param)
            return default

    def check(self, also: APIError | None = None) -> None:
        """Raise one 400 naming every problem so far (and `also`, an error that stopped the
        reading), or nothing when there is none."""
        problems = list(self.problems)
        if also is not None:
            if also.status != 400:
                raise also
            problems.append((also.message, also.param))
        if not problems:
            return
        if len(problems) == 1:
            raise APIError(400, problems[0][0], param=problems[0][1])
        text = "; ".join(f"({i}) {m}" for i, (m, _) in enumerate(problems, 1))
        raise APIError(400, f"{len(problems)} problems: {text}", param=problems[0][1])

    @property
    def header(self) -> dict[str, str]:
        """The response headers that record what was ignored and what translated (none when
        nothing was). A name can hold a client's text (a tool's type): escaped to ASCII and cut
        short, so a header is never broken, split or huge."""
        out = {}
        for name, items in (("x-flashmoe-ignored", self.ignored), ("x-flashmoe-translated", self.translated)):
            if items:
                value = ", ".join(items).encode("ascii", "backslashreplace").decode("ascii")
                out[name] = value if len(value) <= HEADER_CHARS else value[: HEADER_CHARS - 3] + "..."
        return out
