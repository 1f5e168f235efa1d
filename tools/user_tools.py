"""User tools: command tools from a JSON or YAML file, and Python functions from a module file.

Command tool file: a list (or {"tools": [...]}) of OpenAI tool objects, each with a "command" argv
list. `{arg}` placeholders in the argv are filled from the validated arguments and the argv runs
without a shell, so an argument like `; rm -rf /` stays one literal argument:

    - type: function
      function:
        name: word_count
        description: Count the words in a file.
        parameters:
          type: object
          properties: {file: {type: string}}
          required: [file]
      command: [wc, -w, "{file}"]
      paths: [file]        # optional: arguments the sandbox checks as workspace paths
      timeout: 30          # optional, seconds
      allow_leading_at: false  # optional: let a value start an item with '@' (see option_injection)

The flat form {name, description, parameters, command} is accepted too. An argv item whose
placeholder names an absent optional argument (without a schema default) is left out; `{{` and `}}`
are literal braces. argv[0] must be fixed, and so must the program behind a wrapper (`env`, `nice`);
a placeholder may not sit inside code a shell or interpreter runs (`sh -c`, `python -c`, `awk`'s
program): pass it as a positional argument. A filled item may not start with '-' or '@' where the
model's value put it (see option_injection). Command tools have risk "exec".

Python tools: every public top-level function defined in the file (or those in `__all__`) becomes a
tool; type hints give the JSON Schema, the docstring's first paragraph the description and its
Google-style "Args:" section the parameter descriptions. A function declares its risk ("read",
"write" or "exec") with the decorator `@risk("read")` (`from tools.user_tools import risk`), a
`Risk: read` line in its docstring, or a `risk` attribute; one that declares none is "exec", the
safe default (it always asks), and the approval question says how to declare it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union

from flashmoe.tools.errors import ToolDefinitionError, ToolFileError
from flashmoe.tools.registry import RISKS, Tool
from flashmoe.tools.runner import CommandRunner, ToolResult

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")


# ---- command tools from JSON / YAML ------------------------------------------------------------


def _parse_template(path: str, tool: str, item: str) -> list[str | tuple[str]]:
    """Split an argv item into literal strings and ("argname",) placeholders."""
    parts: list[str | tuple[str]] = []
    pos = 0
    for m in _PLACEHOLDER.finditer(item):
        if m.start() > pos:
            parts.append(item[pos : m.start()])
        tok = m.group(0)
        if tok in ("{{", "}}"):
            parts.append(tok[0])
        elif tok in ("{", "}"):
            raise ToolFileError(
                path,
                f"tool '{tool}': unbalanced brace in command item {item!r} (write {{{{ or }}}} for a literal brace)",
            )
        else:
            name = (m.group(1) or "").strip()
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_-]*$", name):
                raise ToolFileError(path, f"tool '{tool}': bad placeholder {tok!r} in command item {item!r}")
            parts.append((name,))
        pos = m.end()
    if pos < len(item):
        parts.append(item[pos:])
    return parts


def _arg_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return ""
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(value, ensure_ascii=False)


def fill_command(
    template: list[list[str | tuple[str]]], arguments: dict[str, Any], defaults: dict[str, Any]
) -> list[str]:
    """The argv for one call: placeholders replaced by argument text, items with absent args dropped."""
    argv: list[str] = []
    for parts in template:
        out: list[str] = []
        keep = True
        for p in parts:
            if isinstance(p, tuple):
                name = p[0]
                if name in arguments:
                    out.append(_arg_text(arguments[name]))
                elif name in defaults:
                    out.append(_arg_text(defaults[name]))
                else:
                    keep = False
                    break
            else:
                out.append(p)
        if keep:
            argv.append("".join(out))
    return argv


def _filled_item(
    parts: list[str | tuple[str]], arguments: dict[str, Any], defaults: dict[str, Any]
) -> tuple[str, str | None]:
    """An argv item as it will be filled, and the argument its first character comes from (None
    when it comes from the definition itself: a literal or a default)."""
    text, source = "", None
    for p in parts:
        if isinstance(p, tuple):
            name = p[0]
            value = _arg_text(arguments[name]) if name in arguments else _arg_text(defaults.get(name))
            if not text and value:
                source = name if name in arguments else None
            text += value
        else:
            text += p
    return text, source


def option_injection(
    template: list[list[str | tuple[str]]],
    arguments: dict[str, Any],
    defaults: dict[str, Any],
    *,
    allow_leading_at: bool = False,
) -> str | None:
    """A refusal when an argv item, filled, would start with a '-' or an '@' that a model's value
    put there: the program would read it as an option (`sort {file}` given `-o/elsewhere` writes
    there; `{dir}{name}` with dir empty is the same) or as a response file (gcc, clang, binutils,
    javac and 7z read options from `@FILE`, which the model may have written first). Each item is
    checked as a whole, numbers included (-1 is an option too). Items after a literal `--` in the
    definition are operands, so they may start with '-'; '@' stays refused unless the definition
    says `allow_leading_at` (response files are read before options are parsed)."""
    operands = False
    for parts in template[1:]:
        if parts == ["--"]:
            operands = True
            continue
        text, source = _filled_item(parts, arguments, defaults)
        if source is None:
            continue
        shown = text if len(text) <= 60 else text[:59] + "…"
        if text.startswith("-") and not operands:
            return (
                f"the value {shown!r} of '{source}' would be read as an option by {_literal(template[0])}; "
                "give a value that does not start with '-' (for a file, write ./ in front of its name)"
            )
        if text.startswith("@") and not allow_leading_at:
            return (
                f"the value {shown!r} of '{source}' would make {_literal(template[0])} read its options from "
                "a file (a response file, @FILE); give a value that does not start with '@' (for a file, "
                "write ./ in front of its name)"
            )
    return None


# Programs that run code written on their command line. A placeholder inside that code would let
# the model write code (`["sh", "-c", "wc -l {file}"]` given `x; touch /outside/p`), and no quoting
# is right for every language and context, so such a definition is refused; the value can go in as
# a positional argument instead (`["sh", "-c", 'wc -l "$1"', "sh", "{file}"]`). Shells are read by
# tools/shellwords.py (-c, bundled or not); the rest: {name: (short options whose value is code,
# long ones, whether the first operand is the code unless an option gave it or named a file,
# options naming a code file, other short options that take a value)}.
_INTERPRETERS: dict[str, tuple[str, frozenset[str], bool, str, str]] = {
    "python": ("c", frozenset(), False, "", "WXmQ"),
    "pypy": ("c", frozenset(), False, "", "WXm"),
    "perl": ("eE", frozenset(), False, "", "IMmx"),
    "ruby": ("e", frozenset(), False, "", "IrCEFx"),
    "node": ("ep", frozenset({"--eval", "--print"}), False, "", "r"),
    "bun": ("e", frozenset({"--eval"}), False, "", ""),
    "php": ("rBRE", frozenset(), False, "", "cdz"),
    "lua": ("e", frozenset(), False, "", "l"),
    "luajit": ("e", frozenset(), False, "", "lj"),
    "rscript": ("e", frozenset(), False, "", ""),
    "osascript": ("e", frozenset(), False, "", "sl"),
    "tclsh": ("", frozenset(), False, "", ""),
    "awk": ("e", frozenset({"--source"}), True, "f", "Fvi"),
    "sed": ("e", frozenset({"--expression"}), True, "f", "l"),
}
_ALIASES = {"nodejs": "node", "gawk": "awk", "mawk": "awk", "nawk": "awk", "gsed": "sed", "perl5": "perl"}


def _interpreter(name: str) -> tuple[str, frozenset[str], bool, str, str] | None:
    name = name.lower()
    base = _ALIASES.get(name) or re.sub(r"[\d.]+$", "", name)  # python3.11 -> python
    return _INTERPRETERS.get(base)


def _code_items(words: list[str]) -> list[int]:
    """The indexes of the items of a command that hold code its program runs (after wrappers)."""
    from flashmoe.tools import shellwords

    rest, _ = shellwords.unwrap(words)
    offset = len(words) - len(rest)
    if not rest:
        return []
    name = os.path.basename(rest[0])
    if name in shellwords.SHELLS:
        at, _ = shellwords.shell_script(rest)
        return [] if at is None else [offset + at]
    spec = _interpreter(name)
    if spec is None:
        return []
    short, long, first_operand, files, values = spec
    found: list[int] = []
    i = 1
    while i < len(rest):
        w = rest[i]
        if w == "--":
            i += 1
            break
        if w.startswith("--"):
            if w.split("=", 1)[0] in long:
                found.append(offset + i + (0 if "=" in w else 1))
            i += 1 if "=" in w or w not in long else 2
            continue
        if not w.startswith("-") or w == "-":
            break
        i += 1
        for k, letter in enumerate(w[1:], 1):
            if letter in short or letter in files or letter in values:
                if letter in short:
                    found.append(offset + (i - 1 if w[k + 1 :] else i))
                if letter in files:
                    first_operand = False
                if not w[k + 1 :]:
                    i += 1
                break
    if first_operand and not found and i < len(rest):
        found.append(offset + i)
    return [f for f in found if f < len(words)]


def script_problem(template: list[list[str | tuple[str]]], raw: list[str]) -> str | None:
    """Why a command definition must be refused: a placeholder as the program behind a wrapper
    (`["env", "{prog}"]`), or inside code its shell or interpreter runs."""
    from flashmoe.tools import shellwords

    placeholders = [any(isinstance(p, tuple) for p in parts) for parts in template]
    rest, lines = shellwords.unwrap(raw)
    if rest and placeholders[len(raw) - len(rest)]:
        return f"the program {raw[len(raw) - len(rest)]!r} that {raw[0]} runs must be fixed, not a placeholder"
    for i in [*_code_items(raw), *(j for j, w in enumerate(raw) if w in lines)]:
        if placeholders[i]:
            program = os.path.basename(rest[0]) if rest else raw[0]
            return (
                f"command item {raw[i]!r} is a script that {program} runs, and a placeholder in it would let the "
                'model write code; pass the value as a positional argument instead (e.g. ["sh", "-c", '
                '\'wc -l "$1"\', "sh", "{file}"]), or to a script file'
            )
    return None


def _literal(parts: list[str | tuple[str]]) -> str:
    return "".join(p for p in parts if isinstance(p, str))


def _command_tool(path: str, obj: Any, index: int, runner: CommandRunner) -> Tool:
    where = f"tool #{index + 1}"
    if not isinstance(obj, dict):
        raise ToolFileError(path, f"{where} is a {type(obj).__name__}, expected an object")
    fn = obj.get("function") if obj.get("type", "function") == "function" and "function" in obj else obj
    if not isinstance(fn, dict):
        raise ToolFileError(path, f'{where}: "function" must be an object')
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolFileError(path, f"{where} has no name")
    where = f"tool '{name}'"
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ToolFileError(path, f"{where}: parameters must be a JSON Schema object")
    props = params.get("properties") or {}
    command = obj.get("command", fn.get("command"))
    if (
        not isinstance(command, list)
        or not command
        or not all(isinstance(c, (str, int, float)) and not isinstance(c, bool) for c in command)
    ):
        raise ToolFileError(path, f'{where}: "command" must be a non-empty list of strings (an argv, not a shell line)')
    template = [_parse_template(path, name, str(c)) for c in command]
    if any(isinstance(p, tuple) for p in template[0]):
        raise ToolFileError(path, f"{where}: the program (command[0]) must be fixed, not a placeholder")
    problem = script_problem(template, [str(c) for c in command])
    if problem:
        raise ToolFileError(path, f"{where}: {problem}")
    allow_at = obj.get("allow_leading_at", False)
    if not isinstance(allow_at, bool):
        raise ToolFileError(path, f'{where}: "allow_leading_at" must be true or false')
    for parts in template:
        for p in parts:
            if isinstance(p, tuple) and p[0] not in props:
                raise ToolFileError(
                    path, f"{where}: placeholder {{{p[0]}}} is not one of its parameters ({', '.join(props) or 'none'})"
                )
    defaults = {k: v["default"] for k, v in props.items() if isinstance(v, dict) and "default" in v}
    paths = obj.get("paths", [])
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ToolFileError(path, f'{where}: "paths" must be a list of parameter names')
    timeout = obj.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ToolFileError(path, f'{where}: "timeout" must be a positive number of seconds')

    def run(**arguments: Any) -> ToolResult:
        return runner.run(fill_command(template, arguments, defaults), timeout=timeout)

    def check(arguments: dict[str, Any]) -> str | None:
        return option_injection(template, arguments, defaults, allow_leading_at=allow_at)

    try:
        return Tool(
            name,
            str(fn.get("description", "")),
            params,
            run,
            "exec",
            path_args=tuple(paths),
            source=path,
            check=check,
            self_limited=True,
            resolved_paths=True,
        )
    except ToolDefinitionError as e:
        raise ToolFileError(path, str(e).replace(f" ({path})", "")) from None


def load_tool_file(path: str | os.PathLike[str], runner: CommandRunner | None = None) -> list[Tool]:
    """Command tools from a .json, .yaml or .yml file; the runner sets cwd, timeout and output cap."""
    p = Path(path)
    shown = str(path)
    try:
        text = _read_tool_file(p)
    except FileNotFoundError:
        raise ToolFileError(shown, "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ToolFileError(
            shown, f"cannot read: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
        ) from None
    try:
        return _tools_from_text(p, shown, text, runner)
    except RecursionError:
        raise ToolFileError(shown, "nested too deeply to read") from None


MAX_TOOL_FILE_BYTES = 16 << 20


def _read_tool_file(p: Path) -> str:
    """The file's text: a regular file (a FIFO would block) of sane size."""
    import stat

    fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(0, "not a regular file")
        if st.st_size > MAX_TOOL_FILE_BYTES:
            raise OSError(0, f"{st.st_size:,} bytes; a tool file is at most {MAX_TOOL_FILE_BYTES:,}")
        return f.read().decode("utf-8")


def _tools_from_text(p: Path, shown: str, text: str, runner: CommandRunner | None) -> list[Tool]:
    suffix = p.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ToolFileError(shown, f"invalid JSON: {e}") from None
    elif suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ToolFileError(shown, f"invalid YAML{at}: {problem}") from None
    else:
        raise ToolFileError(shown, "unknown tool file type; use .json, .yaml or .yml (or .py for Python tools)")
    if isinstance(data, dict) and "tools" in data:
        data = data["tools"]
    if not isinstance(data, list):
        raise ToolFileError(shown, 'expected a list of tool objects (or {"tools": [...]})')
    runner = runner or CommandRunner()
    tools = [_command_tool(shown, obj, i, runner) for i, obj in enumerate(data)]
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ToolFileError(shown, f"tool '{dup}' is defined twice")
    return tools


# ---- Python tools ------------------------------------------------------------------------------

_NONE = type(None)


def schema_for_type(hint: Any) -> dict[str, Any]:
    """JSON Schema for a type hint; raises TypeError for hints it cannot express."""
    if hint is inspect.Parameter.empty:
        raise TypeError("missing type hint")
    if hint is Any:
        return {}
    if hint is str:
        return {"type": "string"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint is _NONE or hint is None:
        return {"type": "null"}
    if hint in (list, typing.List):  # noqa: UP006
        return {"type": "array"}
    if hint in (dict, typing.Dict):  # noqa: UP006
        return {"type": "object"}
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Literal:
        values = list(args)
        if not all(isinstance(v, (str, int, float, bool)) or v is None for v in values):
            raise TypeError(f"Literal values must be str, int, float, bool or None: {hint!r}")
        schema: dict[str, Any] = {"enum": values}
        kinds = {
            (
                "boolean"
                if isinstance(v, bool)
                else "integer"
                if isinstance(v, int)
                else "number"
                if isinstance(v, float)
                else "null"
                if v is None
                else "string"
            )
            for v in values
        }
        if len(kinds) == 1:
            schema = {"type": kinds.pop(), "enum": values}
        return schema
    if origin in (Union, types.UnionType):
        members = [a for a in args if a is not _NONE]
        nullable = len(members) < len(args)
        subs = [schema_for_type(a) for a in members]
        if len(subs) == 1:
            sub = subs[0]
            if not nullable:
                return sub
            if set(sub) <= {"type", "enum", "items", "additionalProperties"} and isinstance(sub.get("type"), str):
                out = dict(sub, type=[sub["type"], "null"])
                if "enum" in out:
                    out["enum"] = [*out["enum"], None]
                return out
            return {"anyOf": [sub, {"type": "null"}]}
        return {"anyOf": subs + ([{"type": "null"}] if nullable else [])}
    if origin in (list, typing.List):  # noqa: UP006
        return {"type": "array", "items": schema_for_type(args[0])} if args else {"type": "array"}
    if origin in (dict, typing.Dict):  # noqa: UP006
        if args and args[0] is not str:
            raise TypeError(f"dict keys must be str in JSON: {hint!r}")
        return {"type": "object", "additionalProperties": schema_for_type(args[1])} if args else {"type": "object"}
    shown = hint.__name__ if isinstance(hint, type) else repr(hint)
    raise TypeError(f"unsupported type hint {shown}")


_SECTION = re.compile(
    r"^(Args|Arguments|Parameters|Params|Returns|Return|Yields|Raises|Examples?|Notes?|"
    r"Attributes|See Also|Warnings?|Todo)\s*:\s*$"
)
_ARG_LINE = re.compile(r"^\*{0,2}([A-Za-z_][A-Za-z0-9_]*)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc: list[str] = []
    i = 0
    while i < len(lines) and lines[i].strip() and not _SECTION.match(lines[i].strip()):
        desc.append(lines[i].strip())
        i += 1
    params: dict[str, str] = {}
    in_args = False
    indent = None
    current: str | None = None
    for line in lines[i:]:
        stripped = line.strip()
        m = _SECTION.match(stripped)
        if m and (len(line) - len(line.lstrip())) == 0:
            in_args = m.group(1) in ("Args", "Arguments", "Parameters", "Params")
            indent, current = None, None
            continue
        if not in_args or not stripped:
            continue
        ind = len(line) - len(line.lstrip())
        if indent is None:
            indent = ind
        am = _ARG_LINE.match(stripped)
        if ind <= indent and am:
            current = am.group(1)
            params[current] = am.group(3).strip()
        elif current is not None and ind > indent:
            params[current] = (params[current] + " " + stripped).strip()
        elif ind < indent:
            in_args = False
    return " ".join(desc), params


_RISK_LINE = re.compile(r"^[ \t]*Risk[ \t]*:[ \t]*(\S*)[ \t]*$\n?", re.MULTILINE | re.IGNORECASE)

# Where the approval question tells the user how to declare a risk (tools/executor.py).
DECLARE_RISK_HINT = (
    "it declares no risk, so it is treated as one that runs commands; if it only reads, "
    'declare it with @risk("read") (from tools.user_tools import risk) or a "Risk: read" '
    'line in its docstring (or "write")'
)


def risk(level: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `@risk("read")` declares what a Python tool does: read, write or exec."""
    if level not in RISKS:
        raise ValueError(f"risk must be one of {', '.join(RISKS)}, not {level!r}")

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.risk = level  # type: ignore[attr-defined]
        return fn

    return mark


def _docstring_risk(doc: str | None) -> tuple[str | None, str | None]:
    """(the docstring without its `Risk:` line, the risk it names or None)."""
    if not doc:
        return doc, None
    doc = inspect.cleandoc(doc)
    m = _RISK_LINE.search(doc)
    if m is None:
        return doc, None
    return doc[: m.start()] + doc[m.end() :], m.group(1).strip().lower()


def tool_from_function(fn: Callable[..., Any], *, risk: str | None = None, source: str = "") -> Tool:
    """A Tool whose JSON Schema comes from fn's signature and type hints; raises TypeError/ValueError
    with a message naming the parameter when fn cannot be a tool."""
    name = fn.__name__
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # unresolvable string annotations
        raise TypeError(f"function '{name}': cannot resolve type hints: {e}") from None
    doc, doc_risk = _docstring_risk(fn.__doc__)
    description, arg_docs = parse_docstring(doc)
    props: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"function '{name}': *{pname}/**{pname} parameters cannot be tool arguments")
        if param.kind is param.POSITIONAL_ONLY:
            raise TypeError(f"function '{name}': positional-only parameter '{pname}' cannot be a tool argument")
        if pname not in hints:
            raise TypeError(f"function '{name}': parameter '{pname}' has no type hint")
        try:
            schema = schema_for_type(hints[pname])
        except TypeError as e:
            raise TypeError(f"function '{name}': parameter '{pname}': {e}") from None
        if pname in arg_docs and arg_docs[pname]:
            schema = {**schema, "description": arg_docs[pname]}
        if param.default is param.empty:
            required.append(pname)
        else:
            try:
                json.dumps(param.default)
            except (TypeError, ValueError):
                raise TypeError(f"function '{name}': the default of '{pname}' is not JSON-serialisable") from None
            schema = {**schema, "default": param.default}
        props[pname] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        parameters["required"] = required
    declared = risk or getattr(fn, "risk", None) or doc_risk
    chosen = declared or "exec"
    if chosen not in RISKS:
        raise ValueError(f"function '{name}': risk must be one of {', '.join(RISKS)}, not {chosen!r}")

    def call(**arguments: Any) -> Any:
        return fn(**arguments)

    call.__name__ = name
    call.risk_undeclared = not declared  # type: ignore[attr-defined]  (the approval question says how)
    return Tool(name, description or name, parameters, call, chosen, source=source)  # type: ignore[arg-type]


def load_python_tools(path: str | os.PathLike[str], *, risk: str | None = None) -> list[Tool]:
    """Tools from the public top-level functions of a Python file (see the module docstring)."""
    p = Path(path)
    shown = str(path)
    if p.suffix != ".py":
        raise ToolFileError(shown, "Python tools must come from a .py file")
    if not p.is_file():
        raise ToolFileError(shown, "no such file")
    digest = hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:10]
    modname = f"flashmoe_user_tools_{re.sub(r'[^0-9A-Za-z_]', '_', p.stem)}_{digest}"
    spec = importlib.util.spec_from_file_location(modname, p)
    if spec is None or spec.loader is None:
        raise ToolFileError(shown, "cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(modname, None)
        raise ToolFileError(shown, f"syntax error at line {e.lineno}: {e.msg}") from None
    except Exception as e:
        sys.modules.pop(modname, None)
        raise ToolFileError(shown, f"import failed: {type(e).__name__}: {e}") from None
    exported = getattr(module, "__all__", None)
    if exported is not None:
        names = list(exported)
        missing = [n for n in names if not inspect.isfunction(getattr(module, n, None))]
        if missing:
            verb = "is" if len(missing) == 1 else "are"
            raise ToolFileError(shown, f"__all__ names {', '.join(missing)}, which {verb} not a function")
    else:
        names = [
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == modname and not n.startswith("_")
        ]
    if not names:
        raise ToolFileError(shown, "defines no public top-level functions")
    tools: list[Tool] = []
    for n in names:
        try:
            tools.append(tool_from_function(getattr(module, n), risk=risk, source=shown))
        except (TypeError, ValueError, ToolDefinitionError) as e:
            raise ToolFileError(shown, str(e).replace(f" ({shown})", "")) from None
    return tools
