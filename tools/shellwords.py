"""What a shell command line runs: its simple commands as argv lists, for deny and allow rules.

Rules must match what runs, not how it is spelled: `rm`, `/bin/rm`, `'rm'`, `\\rm`, `command rm`,
`env FOO=1 rm`, `sh -c 'rm x'` and `find . -exec rm {} ;` all run rm. This module splits a line with
shlex into simple commands, drops assignments, redirections and wrapper programs, and names the
program by its basename. What it cannot decide statically (a program word built from `$`, a glob or
a command substitution) it reports as unresolved, and the policy treats that as matching every deny
rule: a rule the user wrote is never skipped because the command was hard to read.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

_SEPARATORS = frozenset({";", "&", "&&", "|", "||", "|&", ";;", "\n", "(", ")", "{", "}", "!", "`"})
_REDIRECT = re.compile(r"^(?:[<>]+[&|]?|&>>?)$")
_PUNCT = re.compile(r"^[;&|()<>\n`]+$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\[[^]]*\])?\+?=")
_UNRESOLVABLE = re.compile(r"[$`*?\[]")
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "fish"})
# Programs whose -c argument is a shell line.
_DASH_C = SHELLS | {"su", "runuser", "flock"}

# Wrapper programs: (options that take a separate value, whether a leading bare word is theirs).
# After their options, the next word is the program they run.
_WRAPPERS: dict[str, tuple[frozenset[str], int]] = {
    "command": (frozenset(), 0), "builtin": (frozenset(), 0), "exec": (frozenset({"-a"}), 0),
    "env": (frozenset({"-u", "--unset", "-C", "--chdir", "-S", "--split-string"}), 0),
    "nice": (frozenset({"-n", "--adjustment"}), 0), "nohup": (frozenset(), 0), "time": (frozenset({"-f", "-o"}), 0),
    "timeout": (frozenset({"-s", "--signal", "-k", "--kill-after"}), 1), "stdbuf": (frozenset({"-i", "-o", "-e"}), 0),
    "sudo": (frozenset({"-u", "-g", "-C", "-D", "-h", "-p", "-r", "-t", "-U", "-T", "--user", "--group"}), 0),
    "doas": (frozenset({"-u", "-C"}), 0), "xargs": (frozenset({"-I", "-n", "-L", "-P", "-s", "-d", "-E", "-a", "-i",
                                                                "--max-args", "--max-procs", "--delimiter",
                                                                "--arg-file", "--replace"}), 0),
    "busybox": (frozenset(), 0), "chroot": (frozenset({"--userspec", "--groups"}), 1),
    "ionice": (frozenset({"-c", "-n", "-p", "--class", "--classdata"}), 0), "setsid": (frozenset(), 0),
    "unbuffer": (frozenset(), 0), "chrt": (frozenset(), 1), "taskset": (frozenset(), 1),
    "watch": (frozenset({"-n", "--interval", "-d"}), 0),
}
# find's actions that run a command: the words after them, up to ';' or '+', are an argv.
_FIND_EXEC = frozenset({"-exec", "-execdir", "-ok", "-okdir"})


@dataclass(frozen=True)
class SimpleCommand:
    """One program run by the line: `argv[0]` is the program as written, `program` its basename
    ('' when it cannot be known statically), `wrapped` whether a wrapper or assignment came first."""

    argv: tuple[str, ...]
    program: str
    wrapped: bool = False

    @property
    def normalized(self) -> str:
        """The basename and the arguments joined by single spaces: what rules match."""
        return " ".join((self.program or self.argv[0], *self.argv[1:]))


def _tokens(line: str) -> list[str] | None:
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()<>\n`")
    lex.whitespace = " \t\r"
    lex.whitespace_split = True
    lex.commenters = ""
    try:
        return list(lex)
    except ValueError:  # an unclosed quote: the shell would refuse it too, but we cannot read it
        return None


def _segments(tokens: list[str]) -> list[list[str]]:
    """Split at separators; drop redirections with their targets (`2>&1`, `>out`, `<in`)."""
    out: list[list[str]] = [[]]
    skip_next = False
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if skip_next:
            skip_next = False
        elif tok in _SEPARATORS or (_PUNCT.match(tok) and ("(" in tok or ")" in tok)):
            out.append([])
        elif _REDIRECT.match(tok):
            skip_next = True  # the redirection's target is a file name, not an argument
        elif not (tok.isdigit() and _REDIRECT.match(nxt)):  # the fd number of `2>`
            out[-1].append(tok)
    return [s for s in out if s]


def _unwrap(words: list[str]) -> tuple[list[str], bool]:
    """Drop assignments and wrapper programs in front of the real program."""
    wrapped = False
    while words:
        first = words[0]
        if _ASSIGNMENT.match(first):
            words, wrapped = words[1:], True
            continue
        name = os.path.basename(first)
        if name not in _WRAPPERS:
            break
        takes_value, bare = _WRAPPERS[name]
        i = 1
        while i < len(words):
            w = words[i]
            if w == "--":
                i += 1
                break
            if _ASSIGNMENT.match(w) and name in ("env", "sudo"):
                i += 1
            elif w.startswith("-") and len(w) > 1:
                i += 2 if (w in takes_value) else 1
            else:
                break
        i += bare if i < len(words) else 0
        words, wrapped = words[i:], True
    return words, wrapped


def commands(line: str, _depth: int = 0) -> list[SimpleCommand] | None:
    """The simple commands a line runs, or None when it cannot be split (an unclosed quote)."""
    tokens = _tokens(line)
    if tokens is None:
        return None
    out: list[SimpleCommand] = []
    if re.search(r"`|[$<>]\(", line):
        # A substitution's output becomes words of the line: what runs is known only then.
        out.append(SimpleCommand(("<command substitution>",), ""))
    for seg in _segments(tokens):
        words, wrapped = _unwrap(seg)
        if not words:
            continue
        prog = words[0]
        name = "" if _UNRESOLVABLE.search(prog) else os.path.basename(prog)
        script = None
        if name in _DASH_C:
            script = next((words[i + 1] for i, w in enumerate(words[:-1]) if re.fullmatch(r"-[a-z]*c[a-z]*", w)), None)
        elif name == "eval":  # eval runs its arguments as a line
            script = " ".join(words[1:])
        if script is not None and _depth < 8:
            if script is not None:
                inner = commands(script, _depth + 1)
                if inner is None:
                    return None
                out.extend(inner)
        if name == "find":
            for i, w in enumerate(words):
                if w in _FIND_EXEC:
                    rest = words[i + 1:]
                    end = next((j for j, x in enumerate(rest) if x in (";", "+", "\\;")), len(rest))
                    inner = " ".join(shlex.quote(x) for x in rest[:end])
                    out.extend(commands(inner, _depth + 1) or [SimpleCommand(tuple(rest[:end]) or ("",), "")])
        out.append(SimpleCommand(tuple(words), name, wrapped))
    return out


def has_expansion(line: str) -> bool:
    """Whether the shell would expand anything: variables, substitutions, globs, braces, a tilde
    starting a word, escapes. An allow rule never covers such a line (a planted file named
    `--output=x` would arrive through `*`)."""
    return bool(re.search(r"[$`*?\[\]{}\\]|(?:^|[\s=:])~", line))
