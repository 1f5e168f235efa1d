"""Helpers the format parsers share: finding marked blocks, decoding JSON call objects leniently."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from flashmoe.tools.calls import ToolCall

_DECODER = json.JSONDecoder()
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?[ \t]*```\s*$", re.DOTALL)
# Tolerates the low-bit quoting failure (\name\ for "name") so a broken call still gets a name.
_NAME_KEY = re.compile(r"""[\\"']*name[\\"']*\s*:\s*[\\"']*([A-Za-z0-9_.\-]+)""")
_ARGS_KEY = re.compile(r"""[\\"']*(?:arguments|parameters|args)[\\"']*\s*:\s*""")


def blocks(text: str, start: str, end: str) -> list[tuple[str, str]]:
    """(raw, body) for each start...end block; an unterminated last block runs to the end. Text
    without the start marker is taken as one body (callers may pass just the inside of a call)."""
    if not start or start not in text:
        return [(text, text)]
    out: list[tuple[str, str]] = []
    pos = 0
    while True:
        i = text.find(start, pos)
        if i < 0:
            break
        j = text.find(end, i + len(start)) if end else -1
        if j < 0:
            out.append((text[i:], text[i + len(start) :]))
            break
        out.append((text[i : j + len(end)], text[i + len(start) : j]))
        pos = j + len(end)
    return out


def strip_fence(s: str) -> str:
    """The inside of a ```json ... ``` fence, or s unchanged."""
    m = _FENCE.match(s.strip())
    return m.group(1) if m else s


def json_values(s: str) -> Iterator[tuple[Any, str]]:
    """(value, verbatim text) for each JSON value in s: one object, several in a row, or the items
    of a top-level array. Raises json.JSONDecodeError at the first undecodable one."""
    n = len(s)
    pos = 0

    def skip(p: int, chars: str = " \t\r\n") -> int:
        while p < n and s[p] in chars:
            p += 1
        return p

    pos = skip(pos)
    if pos < n and s[pos] == "[":
        pos = skip(pos + 1)
        while pos < n and s[pos] != "]":
            value, end = _DECODER.raw_decode(s, pos)
            yield value, s[pos:end]
            pos = skip(end, " \t\r\n,")
        return
    while pos < n:
        value, end = _DECODER.raw_decode(s, pos)
        yield value, s[pos:end]
        pos = skip(end, " \t\r\n,;")


def call_from_object(obj: Any, raw: str) -> ToolCall:
    """A ToolCall from a decoded {"name": ..., "arguments": ...} (or OpenAI's {"function": {...}})."""
    if not isinstance(obj, dict):
        return ToolCall(
            None, None, raw, error=f'expected a JSON object with "name" and "arguments", got {json.dumps(obj)[:80]}'
        )
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, raw, error='the tool call has no "name"')
    call_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    for key in ("arguments", "parameters", "args"):
        if key in obj:
            args = obj[key]
            break
    else:
        # Small models sometimes inline the arguments next to the name.
        args = {k: v for k, v in obj.items() if k not in ("name", "id", "type")}
    if isinstance(args, dict):
        return ToolCall(name, args, raw, id=call_id)
    if isinstance(args, str):
        try:
            decoded = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(
                name, None, raw, error="the arguments string is not valid JSON", arguments_text=args, id=call_id
            )
        if isinstance(decoded, dict):
            return ToolCall(name, decoded, raw, id=call_id)
    return ToolCall(
        name,
        None,
        raw,
        error="the arguments are not a JSON object",
        arguments_text=json.dumps(args, ensure_ascii=False),
        id=call_id,
    )


def lenient_call(s: str, raw: str, error: str) -> ToolCall:
    """Best effort for text that is not valid JSON: find the name and cut out the arguments text,
    so validation can say exactly what is wrong (and repair the backslash-quote failure)."""
    m = _NAME_KEY.search(s)
    name = m.group(1) if m else None
    a = _ARGS_KEY.search(s)
    args_text = None
    if a:
        rest = s[a.end() :].rstrip()
        if s.lstrip().startswith("[") and rest.endswith("]"):
            rest = rest[:-1].rstrip()  # the closing bracket of a list of calls
        if rest.endswith("}") and rest.count("}") > rest.count("{"):
            rest = rest[:-1].rstrip()  # the closing brace of the outer call object
        args_text = rest.rstrip(",").rstrip()
    return ToolCall(name, None, raw, error=error, arguments_text=args_text)


def json_calls(body: str, raw: str) -> list[ToolCall]:
    """Calls from a body holding one or more JSON call objects (Hermes, Mistral's list form)."""
    s = strip_fence(body).strip()
    if not s:
        return [ToolCall(None, None, raw, error="empty tool call")]
    values: list[tuple[Any, str]] = []
    try:
        for item in json_values(s):
            values.append(item)
    except json.JSONDecodeError as e:
        # A stray closing brace after a complete call is a common slip; anything else is not.
        tail = s[e.pos :].strip()
        if not values or tail.strip("}] \t\r\n"):
            return [lenient_call(s, raw, f"invalid JSON: {e}")]
    if len(values) == 1:
        return [call_from_object(values[0][0], raw)]
    return [call_from_object(v, text) for v, text in values]


# ---- typed values for formats whose arguments are bare text (XML-ish key/value formats) ---------

_INT = re.compile(r"^[+-]?\d+$")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def schema_types(schema: dict[str, Any]) -> list[str]:
    """The JSON types a property schema allows, in the order it names them."""
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or []:
            if isinstance(sub, dict):
                out.extend(x for x in schema_types(sub) if x not in out)
    if not out and "enum" in schema:
        for v in schema["enum"]:
            kind = (
                "boolean"
                if isinstance(v, bool)
                else "integer"
                if isinstance(v, int)
                else "number"
                if isinstance(v, float)
                else "null"
                if v is None
                else "array"
                if isinstance(v, list)
                else "object"
                if isinstance(v, dict)
                else "string"
            )
            if kind not in out:
                out.append(kind)
    return out


def literal(s: str) -> Any:
    """A Python literal ({'k': 'v'}, ['a', 'b'], True), with JSON's true/false/null allowed too
    (templates render nested values as JSON). Raises ValueError when s is not one."""
    import ast

    try:
        tree = ast.parse(s.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(str(e)) from None
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
            node.__class__ = ast.Constant
            node.value = _JSON_NAMES[node.id]  # type: ignore[attr-defined]
    try:
        value = ast.literal_eval(tree)
    except (ValueError, TypeError, SyntaxError) as e:
        raise ValueError(str(e)) from None
    _check_json_types(value)
    return value


def _check_json_types(value: Any) -> None:
    """Raise ValueError for a literal JSON cannot carry: b'..', 1j, {1, 2} (arguments must stay JSON)."""
    if isinstance(value, (bytes, complex, set, frozenset)):
        raise ValueError(f"a {type(value).__name__} value is not JSON")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_json_types(k)
            _check_json_types(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_json_types(v)


def container(s: str, kind: type) -> Any:
    """s decoded as a dict or list (JSON, a Python literal, JSON encoded twice, or JSON whose
    quotes the model escaped as if inside a string: `[{\\"id\\": 1}]`, as GLM writes them), or None."""
    s = s.strip()
    for decode in (json.loads, literal, _escaped_json):
        try:
            v = decode(s)
        except ValueError:  # JSONDecodeError is one
            continue
        if isinstance(v, str) and decode is json.loads:  # double-encoded: "{\"a\": 1}"
            try:
                v = json.loads(v)
            except ValueError:
                continue
        if isinstance(v, kind):
            return v
    return None


def _escaped_json(s: str) -> Any:
    """JSON written with its quotes escaped (`{\\"a\\": 1}`): read as a string's content first."""
    if '\\"' not in s:
        raise ValueError("no escaped quotes")
    try:
        return json.loads(json.loads(f'"{s}"'))
    except (ValueError, TypeError) as e:
        raise ValueError(str(e)) from None


def guess(value: str) -> Any:
    """A value with no schema to go by, for formats whose template writes non-strings as JSON
    (GLM, LongCat, Kimi): JSON or a Python literal if it is one, else the text."""
    s = value.strip()
    for decode in (json.loads, literal):
        try:
            return decode(s)
        except ValueError:
            continue
    return value


def coerce(value: str, schema: dict[str, Any] | None, untyped: str = "string") -> Any:
    """The typed value a bare parameter string stands for, given its property schema. Strings
    stay strings; a value that fits none of the schema's types is left as text, so validation
    names the mismatch. `untyped` says what to do without a schema: keep the "string", or "guess"."""
    if schema is None:
        return guess(value) if untyped == "guess" else value
    types = schema_types(schema)
    s = value.strip()
    if "null" in types and (s in ("null", "None") or (not s and "string" not in types)):
        return None
    if not types:  # e.g. {"description": ...} only: a container if it is one, else like no schema
        v = container(s, (dict, list)) if s[:1] in '{["' else None
        return v if v is not None else coerce(value, None, untyped)
    if "string" in types:
        return value
    for t in types:
        if t in ("integer", "number"):
            if _INT.match(s):
                return int(s)
            try:
                f = float(s)
            except ValueError:
                continue
            if t == "integer" and f.is_integer():
                return int(f)
            if t == "number" and math.isfinite(f):
                return f
        elif t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        elif t in ("object", "array"):
            v = container(s, dict if t == "object" else list)
            if v is not None:
                return v
    return value
