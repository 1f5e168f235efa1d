"""Glob patterns matched in linear time: the one matcher for search globs, deny patterns and rules.

A glob the model writes (search_files' `glob`) is matched against every path in the workspace. As
a backtracking regex (`*a*a*a*...b` became `.*a.*a.*a...b`) one pattern could run for hours inside
the regex engine, holding the GIL, so that neither the tool's time limit, --timeout, Ctrl-C nor
SIGTERM could stop it. Here a pattern is a small automaton run over the text one character at a
time with a set of states (Thompson's construction): time is at most the text's length times the
pattern's, and the loop is Python code, so signals and other threads get their turn.

The language: `*` matches anything, slashes included; `?` one character; `[...]` a class (`!` or
`^` first negates it, `]` first is a member, `a-z` a range, and a `[` with no closing `]` is a
literal); `**/` also matches no directory at all and a trailing `/**` matches the directory itself
(so `**/.env*` covers `.env` and `.git/**` covers `.git`). Every other character is itself.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PATTERN = 4096  # characters: a longer glob is refused (the work grows with its length)


class GlobError(ValueError):
    pass


@dataclass(frozen=True)
class _Class:
    negate: bool
    chars: frozenset[str]
    ranges: tuple[tuple[str, str], ...]

    def __contains__(self, c: str) -> bool:
        found = c in self.chars or any(lo <= c <= hi for lo, hi in self.ranges)
        return found != self.negate


_STAR = object()  # a token: any run of characters
_SPLIT = object()  # a token that reads nothing: go on into an optional group, or skip past it


def _parse_class(pattern: str, i: int) -> tuple[_Class, int] | None:
    """The class opening at pattern[i] == '[', and the index after it; None when it never closes."""
    n = len(pattern)
    j = i + 1
    negate = j < n and pattern[j] in "!^"
    if negate:
        j += 1
    start = j
    if j < n and pattern[j] == "]":
        j += 1
    end = pattern.find("]", j)
    if end < 0:
        return None
    body = pattern[start:end]
    chars, ranges = set(), []
    k = 0
    while k < len(body):
        if k + 2 < len(body) and body[k + 1] == "-":
            lo, hi = body[k], body[k + 2]
            if lo <= hi:  # a reversed range matches nothing
                ranges.append((lo, hi))
            k += 3
        else:
            chars.add(body[k])
            k += 1
    return _Class(negate, frozenset(chars), tuple(ranges)), end + 1


class Glob:
    """A compiled glob; `match(text)` says whether the whole text matches. `word_tail`: the pattern
    may also be followed by a blank and anything after it (command rules: `git status*` covers
    `git status -s` but not `git statusx`)."""

    def __init__(self, pattern: str, *, ignore_case: bool = False, word_tail: bool = False) -> None:
        if len(pattern) > MAX_PATTERN:
            raise GlobError(f"the glob is {len(pattern):,} characters long; at most {MAX_PATTERN:,}")
        self.pattern = pattern
        self.ignore_case = ignore_case
        src = pattern.lower() if ignore_case else pattern
        tokens: list = []  # a character, a _Class, None (any one character), _STAR or _SPLIT
        skips: dict[int, int] = {}  # the _SPLIT opening an optional group -> the index past the group
        i, n = 0, len(src)
        while i < n:
            c = src[i]
            if src.startswith("**/", i):
                skips[len(tokens)] = len(tokens) + 3
                tokens += [_SPLIT, _STAR, "/"]
                i += 3
            elif src.startswith("/**", i) and i + 3 == n:
                skips[len(tokens)] = len(tokens) + 3
                tokens += [_SPLIT, "/", _STAR]
                i += 3
            elif c == "*":
                while i < n and src[i] == "*":
                    i += 1
                tokens.append(_STAR)
            elif c == "?":
                tokens.append(None)
                i += 1
            elif c == "[" and (parsed := _parse_class(src, i)) is not None:
                tokens.append(parsed[0])
                i = parsed[1]
            else:
                tokens.append(c)
                i += 1
        if word_tail:
            skips[len(tokens)] = len(tokens) + 3
            tokens += [_SPLIT, _Class(False, frozenset(" \t"), ()), _STAR]
        self._tokens = tokens
        self._skips = skips
        self._literal = None if (skips or any(not isinstance(t, str) for t in tokens)) else "".join(tokens)

    def _closure(self, states: set[int]) -> set[int]:
        """The states reachable without reading a character: past a star, into or past an optional
        group."""
        todo = list(states)
        while todo:
            s = todo.pop()
            free = s < len(self._tokens) and (self._tokens[s] is _STAR or self._tokens[s] is _SPLIT)
            for t in (s + 1 if free else -1, self._skips.get(s, -1)):
                if t >= 0 and t not in states:
                    states.add(t)
                    todo.append(t)
        return states

    def match(self, text: str) -> bool:
        if self.ignore_case:
            text = text.lower()
        if self._literal is not None:
            return text == self._literal
        tokens, end = self._tokens, len(self._tokens)
        states = self._closure({0})
        for c in text:
            nxt: set[int] = set()
            for s in states:
                if s == end or tokens[s] is _SPLIT:
                    continue
                tok = tokens[s]
                if tok is _STAR:
                    nxt.add(s)
                elif tok is None or tok == c or (isinstance(tok, _Class) and c in tok):
                    nxt.add(s + 1)
            if not nxt:
                return False
            states = self._closure(nxt)
        return end in states

    def __repr__(self) -> str:
        return f"Glob({self.pattern!r})"
