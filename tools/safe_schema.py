"""JSON Schema checking where a schema's regular expressions meet a model's output.

jsonschema matches `pattern`, `patternProperties` and `format: regex` with Python's `re`, a
backtracking engine that holds the GIL: `"pattern": "^(a+)+$"` against 29 characters of model
output froze every thread of `flashmoe serve` for 24 s (issue 41). Here those keywords are
matched with the `regex` engine instead, with a time limit and the GIL let go while it runs:
SEARCH_S for one match, BUDGET_S for all the matches of one validation. A match that runs out of
time counts against the value (the call is refused, never let through unchecked).

`check_schema` is the one check a tool's (or a reply's) schema passes before it is used: the
metaschema (its patterns compiled by `regex`: a pattern Python's `re` cannot even compile, such as
`a{99999999999999999999}`, raised past jsonschema as an OverflowError), `$ref`s that are local
JSON pointers to a schema, and no loop of references that never descends into the value (a
self-referencing `$ref` recursed until Python's stack ran out).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import regex
from jsonschema import Draft202012Validator, FormatChecker, ValidationError, validators
from jsonschema.exceptions import best_match

SEARCH_S = 0.1  # one pattern on one value
BUDGET_S = 1.0  # every pattern of one validation together

# Keys whose value is a schema, a list of schemas, or a map of name -> schema (Draft 2020-12).
SCHEMA_KEYS = (
    "items",
    "additionalProperties",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
)
SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_MAP_KEYS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
# Of those, the ones that apply to the same value (not to a part of it): a loop through these
# alone never ends.
_SAME_VALUE = ("not", "if", "then", "else", "allOf", "anyOf", "oneOf", "dependentSchemas")


class SchemaProblem(ValueError):
    """A schema this module will not use; `path` says where in it ("" at the top)."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.message, self.path = message, path


class PatternError(ValueError):
    """A regular expression `regex` cannot compile (however it fails: re.error, OverflowError, ...)."""


class SlowPattern(Exception):
    """A match that ran out of its time."""


# -- matching ----------------------------------------------------------------------------------

_local = threading.local()


@contextlib.contextmanager
def budget(seconds: float = BUDGET_S):
    """Every match inside shares `seconds` (on this thread)."""
    outer = getattr(_local, "deadline", None)
    _local.deadline = time.monotonic() + seconds if outer is None else outer
    try:
        yield
    finally:
        _local.deadline = outer


def compile_pattern(pattern: str) -> regex.Pattern:
    try:
        return _compiled(pattern)
    except PatternError:
        raise
    except Exception as e:  # noqa: BLE001  (regex.error, OverflowError, RecursionError, MemoryError, ...)
        raise PatternError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'cannot compile'}") from None


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> regex.Pattern:
    if not isinstance(pattern, str):
        raise PatternError("a pattern must be a string")
    return regex.compile(pattern)


def search(pattern: str, text: str) -> bool:
    """Whether `pattern` matches somewhere in `text` (JSON Schema's rule: not anchored). Raises
    SlowPattern past the time left, PatternError for a pattern that does not compile."""
    rx = compile_pattern(pattern)
    deadline = getattr(_local, "deadline", None)
    limit = SEARCH_S if deadline is None else min(SEARCH_S, deadline - time.monotonic())
    if limit <= 0:
        raise SlowPattern
    try:
        return rx.search(text, timeout=limit, concurrent=True) is not None
    except TimeoutError:
        raise SlowPattern from None


def _verdict(pattern: str, text: str) -> bool | str:
    """True / False, or why it could not be decided (said in the validation error)."""
    try:
        return search(pattern, text)
    except SlowPattern:
        return f"matching {text[:40]!r} against the pattern {pattern[:80]!r} took too long"
    except PatternError as e:
        return f"the pattern {pattern[:80]!r} does not compile ({e})"


# -- the keywords that match (Draft 2020-12's meaning, this module's matching) -------------------


def _pattern(validator, pattern, instance, schema):
    if not validator.is_type(instance, "string"):
        return
    found = _verdict(pattern, instance)
    if found is not True:
        yield ValidationError(found if isinstance(found, str) else f"{instance[:200]!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            found = _verdict(pattern, key)
            if isinstance(found, str):
                yield ValidationError(found)
            elif found:
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(validator, extra_schema, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    named = schema.get("properties") or {}
    patterns = list(schema.get("patternProperties") or {})
    extras = []
    for key in instance:
        if key in named:
            continue
        matched = False
        for pattern in patterns:
            found = _verdict(pattern, key)
            if isinstance(found, str):
                yield ValidationError(found)
                return
            if found:
                matched = True
                break
        if not matched:
            extras.append(key)
    if validator.is_type(extra_schema, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra_schema, path=key)
    elif extra_schema is False and extras:  # (jsonschema's words)
        names = ", ".join(repr(k) for k in sorted(extras, key=str))
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            yield ValidationError(
                f"{names} {verb} not match any of the regexes: {', '.join(repr(p) for p in sorted(patterns))}"
            )
        else:
            yield ValidationError(
                f"Additional properties are not allowed ({names} {'was' if len(extras) == 1 else 'were'} unexpected)"
            )


def _format_regex(instance) -> bool:
    if isinstance(instance, str):
        compile_pattern(instance)
    return True


FORMAT_CHECKER = FormatChecker()
FORMAT_CHECKER.checkers = {
    name: check for name, check in Draft202012Validator.FORMAT_CHECKER.checkers.items() if name != "regex"
}
FORMAT_CHECKER.checks("regex", raises=PatternError)(_format_regex)

Validator = validators.extend(
    Draft202012Validator,
    {"pattern": _pattern, "patternProperties": _pattern_properties, "additionalProperties": _additional_properties},
)


def validator(schema: dict) -> Any:
    """A validator for a schema that passed check_schema (formats checked, regex ones included)."""
    return Validator(schema, format_checker=FORMAT_CHECKER)


def first_error(v, instance) -> str | None:
    """`$.path: message` for the most relevant violation, or None when `instance` fits. A value
    whose checking cannot finish (a pattern out of time, nesting past Python's stack) does not fit."""
    try:
        with budget():
            err = best_match(v.iter_errors(instance))
    except RecursionError:
        return "$: nests too deeply to check"
    except Exception as e:  # noqa: BLE001  (a reference that does not resolve, ...: not a fit)
        return f"$: cannot be checked against the schema ({type(e).__name__})"
    return None if err is None else _short(f"{err.json_path}: {err.message}")


def is_valid(schema: dict, instance) -> bool:
    """Whether `instance` fits `schema`; False where it cannot be told (see first_error)."""
    try:
        v = validator(schema)
    except Exception:  # noqa: BLE001  (a schema the validator cannot take)
        return False
    return first_error(v, instance) is None


def _short(text: str, limit: int = 400) -> str:
    """A message that quotes a client's or a model's text, cut to a readable length."""
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2 - 3) :]}"  # (its end says what)


# -- the schema itself --------------------------------------------------------------------------


def check_schema(schema: dict) -> None:
    """Raise SchemaProblem unless `schema` is a Draft 2020-12 schema this module can use (see the
    module docstring)."""
    try:
        error = best_match(
            Draft202012Validator(Draft202012Validator.META_SCHEMA, format_checker=FORMAT_CHECKER).iter_errors(schema)
        )
    except RecursionError:
        raise SchemaProblem("it nests too deeply") from None
    if error is not None:
        raise SchemaProblem(_short(error.message), _short("".join(f"[{p!r}]" for p in error.absolute_path)))
    _check_references(schema)


def _pointer(path: tuple) -> str:
    return "#" + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _subschemas(node: dict):
    """(key, path step, subschema) for each schema directly inside `node`."""
    for key in SCHEMA_KEYS:
        sub = node.get(key)
        if isinstance(sub, list):  # "items" as a list (older drafts)
            for i, s in enumerate(sub):
                yield key, (key, i), s
        elif sub is not None:
            yield key, (key,), sub
    for key in SCHEMA_LIST_KEYS:
        if isinstance(node.get(key), list):
            for i, s in enumerate(node[key]):
                yield key, (key, i), s
    for key in SCHEMA_MAP_KEYS:
        if isinstance(node.get(key), dict):
            for name, s in node[key].items():
                yield key, (key, name), s


def _check_references(schema: dict) -> None:
    """Every $ref is "#" or a "#/json/pointer" to a schema of this document, and no loop of
    references and same-value keywords (allOf, anyOf, not, ...) comes back to where it started
    without descending into the value (validation would recurse for ever). Walked without
    recursion: the nesting is a client's."""
    nodes: dict[str, Any] = {}
    todo = [((), schema)]
    while todo:
        path, node = todo.pop()
        nodes[_pointer(path)] = node
        if isinstance(node, dict):
            todo.extend((path + step, sub) for _, step, sub in _subschemas(node))
    dicts = [n for n in nodes.values() if isinstance(n, dict)]
    if any("unevaluatedProperties" in n for n in dicts) and any("patternProperties" in n for n in dicts):
        # (jsonschema works out which keys patternProperties evaluated with Python's re)
        raise SchemaProblem("unevaluatedProperties together with patternProperties is not taken")
    edges: dict[str, list[str]] = {}
    for where, node in nodes.items():
        if not isinstance(node, dict):
            continue
        out = edges.setdefault(where, [])
        for key in ("$ref", "$dynamicRef"):
            ref = node.get(key)
            if ref is None:
                continue
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                raise SchemaProblem(
                    f'{key} {str(ref)[:80]!r}: only references inside the schema ("#/...") are taken', where
                )
            target = _normalise(ref)
            if target not in nodes:
                raise SchemaProblem(f"{key} {ref[:80]!r} does not point to a schema in this document", where)
            out.append(target)
        for key, step, _ in _subschemas(node):
            if key in _SAME_VALUE:
                out.append(_pointer(tuple(_path_of(where)) + step))
    _refuse_loops(edges)


def _path_of(pointer: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in pointer[2:].split("/")] if len(pointer) > 1 else []


def _normalise(ref: str) -> str:
    """A reference as _pointer writes it (percent-escapes decoded)."""
    from urllib.parse import unquote

    return unquote(ref).rstrip("/") or "#"


def _refuse_loops(edges: dict[str, list[str]]) -> None:
    """Depth-first search for a cycle, iteratively (white / grey / black)."""
    state: dict[str, int] = {}
    for start in edges:
        if state.get(start):
            continue
        stack = [(start, iter(edges.get(start, ())))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            for child in children:
                if state.get(child) == 1:
                    raise SchemaProblem(
                        f"its references loop without descending into the value ({child} refers back to itself)", child
                    )
                if not state.get(child):
                    state[child] = 1
                    stack.append((child, iter(edges.get(child, ()))))
                    break
            else:
                state[node] = 2
                stack.pop()


__all__ = [
    "SchemaProblem",
    "PatternError",
    "SlowPattern",
    "budget",
    "check_schema",
    "compile_pattern",
    "first_error",
    "is_valid",
    "search",
    "validator",
]
