"""Options that turn a command which looks like it only reads into one that writes files or runs
programs. An allow rule such as `run_shell(git diff*)` never covers a line using one of them: the
user allowed looking at a diff, not `git diff --output=/etc/x`.

The table is data, from each program's manual page (git-diff(1), git(1), find(1), sort(1), tar(1),
rg(1), rsync(1), curl(1), wget(1), zip(1), sed(1), ssh(1)); a program not listed here is matched by
its allow rule alone, and docs/security.md says so.
"""

from __future__ import annotations

import os

SIDE_EFFECT_OPTIONS: dict[str, frozenset[str]] = {
    # git: write files, run programs, or point git at another repository or config
    "git": frozenset(
        {
            "--output",
            "--output-directory",
            "-o",
            "--ext-diff",
            "--exec",
            "-x",
            "--upload-pack",
            "--receive-pack",
            "--config-env",
            "-c",
            "-C",
            "--git-dir",
            "--work-tree",
            "--exec-path",
            "--namespace",
            "--no-index",
            "--open-files-in-pager",
            "-O",
            "--extcmd",
            "--tool",
            "-t",
            "--template",
            "--separate-git-dir",
            "--run",
            "--pager",
        }
    ),
    "find": frozenset({"-exec", "-execdir", "-ok", "-okdir", "-delete", "-fprint", "-fprint0", "-fprintf", "-fls"}),
    "sort": frozenset({"-o", "--output", "--compress-program"}),
    "sed": frozenset({"-i", "--in-place"}),
    "tar": frozenset(
        {
            "--to-command",
            "--checkpoint-action",
            "--use-compress-program",
            "-I",
            "--info-script",
            "-F",
            "--new-volume-script",
            "--rsh-command",
            "--rmt-command",
        }
    ),
    "rg": frozenset({"--pre"}),
    "rsync": frozenset({"-e", "--rsh", "--rsync-path"}),
    "curl": frozenset(
        {
            "-o",
            "--output",
            "-O",
            "--remote-name",
            "--remote-name-all",
            "-K",
            "--config",
            "-T",
            "--upload-file",
            "--output-dir",
            "-D",
            "--dump-header",
            "-c",
            "--cookie-jar",
        }
    ),
    "wget": frozenset(
        {
            "-O",
            "--output-document",
            "-o",
            "--output-file",
            "-P",
            "--directory-prefix",
            "-i",
            "--input-file",
            "-a",
            "--append-output",
        }
    ),
    "zip": frozenset({"-T", "--test", "-TT", "--unzip-command"}),
    "ssh": frozenset({"-o", "-F"}),
    "less": frozenset({"-o", "--log-file", "-O", "--LOG-FILE"}),
}


def side_effect_option(argv: tuple[str, ...] | list[str]) -> str | None:
    """The first argument of argv that is a side-effect option of its program, or None."""
    known = SIDE_EFFECT_OPTIONS.get(os.path.basename(argv[0])) if argv else None
    if not known:
        return None
    for arg in argv[1:]:
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-":
            continue
        name = arg.split("=", 1)[0]
        if name in known:
            return arg
        # bundled or attached short options: -ofile, -xO
        if not arg.startswith("--") and any(f"-{c}" in known for c in arg[1:]):
            return arg
    return None
