"""What a shell command line runs: its simple commands as argv lists, for deny and allow rules.

Rules must match what runs, not how it is spelled: `rm`, `/bin/rm`, `'rm'`, `\\rm`, `command rm`,
`env FOO=1 rm`, `sh -c 'rm x'`, `strace -f rm x` and `find . -exec rm {} ;` all run rm. This module
splits a line with shlex into simple commands, drops assignments, redirections, shell keywords and
wrapper programs (WRAPPERS, a table of programs that run their arguments as a command), follows the
command lines that shells' `-c`, `env -S`, `eval`, `trap`, `watch` and `find -exec` run, and names
the program by its basename. Behind a wrapper every later word is also tried as the program
(`guess`), so an option the table does not know cannot hide the command from a deny rule.

What it cannot decide statically it reports as unresolved (program ''), and the policy treats that
as matching every deny rule: a program word built from `$`, a glob, a brace expansion or a command
substitution; a shell that reads its commands from a pipe, a here-string or a file (`... | sh`,
`bash script.sh`, `. ./x`); an alias. Deny rules stay a convenience, not a sandbox: a program that
runs another by its own means (`python -c`, `make`, `git` aliases) is matched as itself.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

_SEPARATORS = frozenset({";", "&", "&&", "|", "||", "|&", ";;", "\n", "(", ")", "{", "}", "`"})
_REDIRECT = re.compile(r"^(?:[<>]+[&|]?|&>>?)$")
_PUNCT = re.compile(r"^[;&|()<>\n`]+$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\[[^]]*\])?\+?=")
# A program word whose text is only known when the shell runs: expansions, globs, braces.
_UNRESOLVABLE = re.compile(r"[$`*?\[{]")
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "fish", "yash", "posh", "tcsh", "csh"})
# Shells' options that take a separate value (`bash -o pipefail -c ...`).
_SHELL_VALUES = frozenset({"-o", "+o", "-O", "+O", "--rcfile", "--init-file"})
# Shell keywords that may come before a command (`then rm x`, `! rm x`, `coproc rm x`).
_KEYWORDS = frozenset({"if", "then", "else", "elif", "while", "until", "do", "!", "coproc"})
# Commands whose effect on later words is only known at run time.
_DYNAMIC = frozenset({"alias", "source", ".", "enable"})


@dataclass(frozen=True)
class Wrapper:
    """A program that runs a command given in its arguments.

    `values`: its short options that take a value (letters; `-u X`, `-uX`, bundled `-iu X`);
    `long_values`: its long options that take a separate value (`--user X`; `--user=X` needs none);
    `words`: bare words of its own before the command (timeout's DURATION, flock's FILE);
    `line`: options whose value is a whole command line (`env -S 'rm x'`, `flock -c 'rm x'`);
    `after`: a word after which the command starts (`gdb --args`)."""

    values: str = ""
    long_values: frozenset[str] = frozenset()
    words: int = 0
    line: frozenset[str] = frozenset()
    after: str = ""


def _w(values: str = "", long_values: str = "", words: int = 0, line: str = "", after: str = "") -> Wrapper:
    return Wrapper(values, frozenset(long_values.split()), words, frozenset(line.split()), after)


# From each program's manual page. A wrapper missing here is matched as itself (its command is
# not seen), so the table errs on the long side.
WRAPPERS: dict[str, Wrapper] = {
    "command": _w(),
    "builtin": _w(),
    "exec": _w("a"),
    "nohup": _w(),
    "setsid": _w(),
    "unbuffer": _w(),
    "env": _w("uCS", "--unset --chdir --split-string", line="-S --split-string"),
    "nice": _w("n", "--adjustment"),
    "time": _w("fo", "--format --output"),
    "timeout": _w("sk", "--signal --kill-after", words=1),
    "stdbuf": _w("ioe", "--input --output --error"),
    "sudo": _w(
        "ugCDhprtUT", "--user --group --chdir --close-from --host --prompt --role --type --other-user --command-timeout"
    ),
    "doas": _w("uC"),
    "run0": _w("", "--user --group --unit --property --description --slice --chdir --setenv"),
    "xargs": _w(
        "InLPsdEa", "--max-args --max-procs --delimiter --arg-file --max-lines --max-chars --eof --process-slot-var"
    ),
    "busybox": _w(),
    "toybox": _w(),
    "chroot": _w("", "--userspec --groups", words=1),
    "ionice": _w("cnpPu", "--class --classdata --pid --pgid --uid"),
    "chrt": _w("", words=1),
    "taskset": _w("", words=1),
    "numactl": _w("CNmipP", "--cpunodebind --physcpubind --membind --interleave --preferred"),
    "watch": _w("nqd", "--interval --differences"),
    "flock": _w("wEc", "--timeout --conflict-exit-code --command", words=1, line="-c --command"),
    "strace": _w(
        "eopsuaEIbOSXP",
        "--output --attach --string-limit --user --env --signal --trace --status --decode-fds --columns",
    ),
    "ltrace": _w("aeEnoPpsSuxXFAD", "--output --align --indent --library --user"),
    "valgrind": _w(),
    "perf": _w("eopCGtrcFjIm", "--event --output --pid --cpu --cgroup --tid --repeat", words=1),
    "gdb": _w(after="--args"),
    "lldb": _w(after="--"),
    "catchsegv": _w(),
    "nocache": _w(),
    "eatmydata": _w(),
    "su": _w("csg", "--command --shell --group --supp-group --whitelist-environment", line="-c --command"),
    "runuser": _w(
        "ugGcs", "--user --group --supp-group --command --shell --whitelist-environment", line="-c --command"
    ),
    "sg": _w("c", line="-c", words=1),
    "setpriv": _w(
        "",
        "--reuid --regid --groups --inh-caps --ambient-caps --bounding-set --securebits --pdeathsig "
        "--selinux-label --apparmor-profile --landlock-access --landlock-rule --seccomp-filter "
        "--ruid --euid --rgid --egid",
    ),
    "unshare": _w(
        "SGRwC",
        "--map-user --map-group --map-users --map-groups --root --wd --setuid --setgid "
        "--propagation --kill-child --monotonic --boottime",
    ),
    "nsenter": _w("tSGrwe", "--target --setuid --setgid --root --wd --env"),
    "systemd-run": _w(
        "pEuMHdt",
        "--property --setenv --unit --description --slice --uid --gid --machine --host "
        "--working-directory --on-calendar --on-active --timer-property --path-property "
        "--socket-property --nice --expand-environment",
    ),
    "script": _w(
        "cEIOBTm", "--command --echo --log-in --log-out --log-io --log-timing --logging-format", line="-c --command"
    ),
    "parallel": _w("jSPnN", "--jobs --sshlogin --max-args --delay --timeout --joblog --results --tmpdir"),
    "fakeroot": _w("sil", "--lib --faked"),
    "xvfb-run": _w("nsfpe", "--server-num --server-args --auth-file --xauth-protocol --error-file"),
    "firejail": _w(),
    "bwrap": _w(
        "",
        "--chdir --unsetenv --uid --gid --hostname --dev --proc --tmpfs --dir "
        "--remount-ro --exec-label --file-label --cap-add --cap-drop --info-fd",
    ),
    "proxychains": _w("f"),
    "proxychains4": _w("f"),
    "torsocks": _w("uapP"),
    "cpulimit": _w("lpe", "--limit --pid"),
    "caffeinate": _w("tw"),
    "dbus-run-session": _w("", "--config-file --dbus-daemon"),
    "dbus-launch": _w(),
    "ssh-agent": _w("aEPt"),
    "with-lock-ex": _w(words=1),
    "tsp": _w("LND"),
    "expect": _w("cf", line="-c"),
}
# Behind a wrapper, how many of its words are tried as the program (its options and their values
# come first; a word further on is an argument of whatever runs), and how many words each keeps.
_GUESSES, _GUESS_WORDS = 32, 256
# find's actions that run a command: the words after them, up to ';' or '+', are an argv.
_FIND_EXEC = frozenset({"-exec", "-execdir", "-ok", "-okdir"})
_FD_EXEC = frozenset({"-x", "--exec", "-X", "--exec-batch"})


@dataclass(frozen=True)
class SimpleCommand:
    """One program run by the line: `argv[0]` is the program as written, `program` its basename
    ('' when it cannot be known statically), `wrapped` whether a wrapper or assignment came first,
    `guess` whether it is one of the readings tried behind a wrapper (rules match it; it is never
    taken for the command that runs)."""

    argv: tuple[str, ...]
    program: str
    wrapped: bool = False
    guess: bool = False

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


def _wrapper_options(spec: Wrapper, words: list[str]) -> tuple[int, list[str]]:
    """Where a wrapper's command starts in `words` (words[0] is the wrapper), and the command lines
    its options carry (env -S)."""
    lines: list[str] = []
    i = 1
    if spec.after:
        return (words.index(spec.after) + 1 if spec.after in words else len(words)), lines
    while i < len(words):
        w = words[i]
        if w == "--":
            i += 1
            break
        if _ASSIGNMENT.match(w):  # env's and sudo's VAR=value
            i += 1
        elif w.startswith("--") and len(w) > 2:
            name, eq, value = w.partition("=")
            if name in spec.line:
                lines.append(value if eq else (words[i + 1] if i + 1 < len(words) else ""))
            i += 1 if eq or name not in spec.long_values | spec.line else 2
        elif w.startswith("-") and len(w) > 1:
            i += 1
            for k, letter in enumerate(w[1:], 1):
                if letter in spec.values:
                    value = w[k + 1 :]
                    if not value and i < len(words):
                        value = words[i]
                        i += 1
                    if f"-{letter}" in spec.line:
                        lines.append(value)
                    break
        else:
            break
    return min(len(words), i + spec.words), lines


def _unwrap(words: list[str]) -> tuple[list[str], bool, list[tuple[str, list[str]]], list[str]]:
    """Drop assignments, keywords and wrapper programs in front of the real program: (its words,
    whether anything was dropped, each wrapper with its later words (every one may be the
    command), the command lines the wrappers' options carry)."""
    wrapped = False
    tails: list[tuple[str, list[str]]] = []
    lines: list[str] = []
    while words:
        first = words[0]
        if _ASSIGNMENT.match(first) or first in _KEYWORDS:
            words, wrapped = words[1:], True
            continue
        name = os.path.basename(first)
        spec = WRAPPERS.get(name)
        if spec is None:
            break
        tails.append((name, words[1:]))
        start, carried = _wrapper_options(spec, words)
        lines += carried
        words, wrapped = words[start:], True
    return words, wrapped, tails, lines


def unwrap(words: list[str]) -> tuple[list[str], list[str]]:
    """The words of the program a wrapped command runs (`env X=1 nice sh -c ...` -> `sh -c ...`),
    and the command lines the wrappers' options carry (`env -S LINE`)."""
    rest, _, _, lines = _unwrap(list(words))
    return rest, lines


def shell_script(words: list[str] | tuple[str, ...]) -> tuple[int | None, bool]:
    """For a shell's argv: (the index of the command line its -c runs, or None; whether it reads
    its commands from stdin or a file instead)."""
    dash_c, i = False, 1
    while i < len(words):
        w = words[i]
        if w == "--":
            i += 1
            break
        if w in _SHELL_VALUES:
            i += 2
        elif w.startswith("--") or (w[:1] in "-+" and len(w) > 1):
            dash_c = dash_c or (w[0] == "-" and not w.startswith("--") and "c" in w[1:]) or w == "--command"
            i += 1
        else:
            break
    if dash_c:
        return (i if i < len(words) else None), False
    informational = any(w in ("--version", "--help", "-h") for w in words[1:])
    return None, not informational


def commands(line: str, _depth: int = 0) -> list[SimpleCommand] | None:
    """The simple commands a line runs, or None when it cannot be split (an unclosed quote)."""
    tokens = _tokens(line)
    if tokens is None:
        return None
    out: list[SimpleCommand] = []
    if re.search(r"`|[$<>]\(", line):
        # A substitution's output becomes words of the line: what runs is known only then.
        out.append(SimpleCommand(("<command substitution>",), ""))

    def follow(script: str, guess: bool = False) -> bool:
        if _depth >= 8:
            return True
        inner = commands(script, _depth + 1)
        if inner is None:
            return False
        out.extend(SimpleCommand(c.argv, c.program, c.wrapped, c.guess or guess) for c in inner)
        return True

    for seg in _segments(tokens):
        words, wrapped, tails, lines = _unwrap(seg)
        for carried in lines:
            if not follow(carried):
                return None
        for wrapper, tail in tails:  # behind a wrapper, any of its first words may be the program
            for k, w in enumerate(tail[:_GUESSES]):
                if not w.startswith("-") and not _ASSIGNMENT.match(w) and w not in ("--", ":::"):
                    if re.search(r"\s", w):
                        follow(w, guess=True)
                    out.append(SimpleCommand(tuple(tail[k : k + _GUESS_WORDS]), os.path.basename(w), True, guess=True))
            if wrapper == "watch" and words:  # watch runs its arguments through sh -c
                follow(" ".join(words), guess=True)
        if not words:
            continue
        prog = words[0]
        name = "" if _UNRESOLVABLE.search(prog) else os.path.basename(prog)
        if name in SHELLS:
            at, reads_input = shell_script(words)
            if at is not None and not follow(words[at]):
                return None
            if reads_input:
                out.append(SimpleCommand((f"<commands {name} reads from its input or a file>",), ""))
        elif name == "eval":  # eval runs its arguments as a line
            if not follow(" ".join(words[1:])):
                return None
        elif name == "trap" and len(words) > 2:  # trap 'CMD' SIGNAL...
            if not follow(words[1]):
                return None
        elif name in _DYNAMIC:
            out.append(SimpleCommand((f"<what {name} makes of the words after it>",), ""))
        if name in ("find", "fd", "fdfind"):
            actions = _FIND_EXEC if name == "find" else _FD_EXEC
            for i, w in enumerate(words):
                if w in actions:
                    rest = words[i + 1 :]
                    end = next((j for j, x in enumerate(rest) if x in (";", "+", "\\;")), len(rest))
                    inner = " ".join(shlex.quote(x) for x in rest[:end])
                    if not follow(inner):
                        out.append(SimpleCommand(tuple(rest[:end]) or ("",), ""))
        out.append(SimpleCommand(tuple(words), name, wrapped))
    return out


def has_expansion(line: str) -> bool:
    """Whether the shell would expand anything: variables, substitutions, globs, braces, a tilde
    starting a word, escapes. An allow rule never covers such a line (a planted file named
    `--output=x` would arrive through `*`)."""
    return bool(re.search(r"[$`*?\[\]{}\\]|(?:^|[\s=:])~", line))
