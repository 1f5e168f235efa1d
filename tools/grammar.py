"""Constrained decoding for tool calls: the sampler may only pick tokens that keep the output a
valid prefix of a call to one of the tools, with arguments that satisfy that tool's JSON Schema.

Built on llguidance (an optional dependency, `pip install llguidance`): its Earley parser with
inline JSON-Schema grammars computes the allowed-token bitmask over the `tokenizers` vocabulary
(about 20 us per token for Qwen3's 151k vocabulary, a few ms at worst while its lexer warms
up). We build its tokenizer from the tokenizer.json text, so transformers is never needed.

Two modes (`tool_call_constraint(tools, mode)`):

* "required" (OpenAI `tool_choice="required"`): the whole reply is constrained from its first
  token. It must be exactly one call (or, with parallel=True, one or more calls separated by
  "\\n"), after which `done()` is True and the generation loop stops; no text before or after.
* "tools": free text, unconstrained (`allowed()` is None, so it costs nothing), until the start
  marker appears, either as its own token or spelled out in pieces. From then on the call is
  constrained exactly as in "required" mode; once the end marker is through, text is free
  again, so further calls (each constrained) and text after them are possible; the end of the
  turn is the model's EOS as usual.

Two formats:

* fmt="json", Qwen3 / Hermes: `<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`.
  The JSON is written compactly the way `json.dumps` does (", " and ": " separators, no other
  whitespace), which is also how the chat templates render it.
* fmt="xml", Qwen3-Coder / Qwen3.5: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
  \\n</parameter>\\n...</function>\\n</tool_call>`. String parameters are raw text (which cannot
  contain "\\n</parameter>"; enum, const, minLength and maxLength hold, pattern and format do
  not), other values are JSON for the property's schema. Parameters come in the order the
  schema lists them; optional ones may be left out.

Grammar choices, for a model that may not know JSON at all:

* one alternative per tool, so the name decides which schema the arguments follow;
* closed_objects (default True): an object schema that lists "properties" and says nothing
  about additionalProperties / patternProperties / unevaluatedProperties gets no extra keys
  (as OpenAI's strict mode requires); the output still satisfies the original schema;
* max_string_length (default "auto"): strings with no maxLength/enum/const/pattern get a
  maxLength, so a string a low-bit model never closes cannot run on until max_tokens: the
  grammar closes it and the call completes (and validates). "auto" gives STRING_BOUND (128
  characters: paths, patterns, names; short enough to close inside a 96-token reply, where the
  demo's real arguments in `flashmoe bench tools` were under 20), COMMAND_BOUND (4,096) to
  command lines and queries (COMMAND_NAMES), and LONG_TEXT_BOUND (65,536) to parameters that
  carry file text (LONG_TEXT_NAMES: content, old_string, new_string, ...), which write_file and
  edit_file take legitimately long (a runaway there is left to max_tokens). An int bounds every string alike; None leaves them unbounded. Numbers,
  arrays without maxItems and free-form objects are unbounded. A call still open at
  max_tokens is closed by ToolCallConstraint.finish() (the generation loop runs on at most
  FINISH_CALL_TOKENS past it).
* budget (the server's max_tokens, a hard limit): the constraint counts the reply's tokens and,
  when the tokens left come down to what closing the open call takes (simulated on a copy of
  the grammar's state: the forced closers, the grammar's forced tokens, the shortest value where
  a value must come), starts finish() early enough that the call closes inside the budget. In
  "required" mode with parallel calls, the reply ends (only the end of sequence is allowed)
  once another call would not fit. At the budget `in_call` is False, so the generation loop
  stops there; a call it cuts is dropped by the server.

Limits: a tool whose schema uses keywords llguidance does not implement (uniqueItems, not,
if/then/else, contains, dependentRequired, ...) falls back to llguidance's "lenient" mode, where
those keywords are ignored, so its output can still fail validation (the factory's `warnings`
say which tools); the text of a string argument can contain the end marker (a parser that cuts
at the first "</tool_call>" would then cut early); in "tools" mode a marker spelled in pieces
whose last token runs on into text that no call can continue is left unconstrained; "required"
mode leaves no room for a <think> block, so use it with thinking off.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from typing import Any

import numpy as np

MODES = ("tools", "required")
FORMATS = ("json", "xml")

# Compact JSON, as json.dumps writes it and the chat templates render it.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Keys whose value is a schema, a list of schemas, or a map of name -> schema.
_SCHEMA_KEYS = (
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
_SCHEMA_LIST_KEYS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP_KEYS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")

# Default string bounds (max_string_length="auto"; see the module docstring). STRING_BOUND is
# what fits in a reply: `flashmoe bench tools` (max_tokens 96) saw the demo run a path on as
# "list_dir.txt.txt.txt..." until max_tokens at 1,024; its real arguments were under 20 characters.
STRING_BOUND = 128
# With a budget: how many tokens before its end the closing cost starts being checked (each
# check plays finish() out on a copy of the grammar: microseconds a token).
FINISH_WINDOW = 64
COMMAND_BOUND = 4096
COMMAND_NAMES = frozenset({"command", "cmd", "query", "url", "prompt", "description", "args", "arguments"})
LONG_TEXT_BOUND = 65536
LONG_TEXT_NAMES = frozenset(
    {
        "content",
        "contents",
        "text",
        "body",
        "data",
        "code",
        "source",
        "patch",
        "diff",
        "old_string",
        "new_string",
        "old_text",
        "new_text",
        "old_str",
        "new_str",
        "replacement",
        "message",
        "input",
        "stdin",
        "script",
    }
)


def _llg():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("constrained decoding needs the llguidance package (pip install llguidance)") from e
    return llguidance


# -- schemas ------------------------------------------------------------------------------


def _normalise_tools(tools: list[dict]) -> list[tuple[str, dict]]:
    """(name, parameters schema) for OpenAI-style definitions (or bare {"name", "parameters"})."""
    if not tools:
        raise ValueError("tool_call_constraint needs at least one tool")
    out: list[tuple[str, dict]] = []
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tool needs a non-empty string name: {tool!r}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise TypeError(f"tool {name!r}: parameters must be a JSON Schema object")
        if any(name == n for n, _ in out):
            raise ValueError(f"tool {name!r} is defined twice")
        out.append((name, params))
    return out


def _is_string_schema(node: dict) -> bool:
    t = node.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t)


def _string_bound(max_string_length: int | str | None, name: str | None) -> int | None:
    if max_string_length == "auto":
        key = (name or "").lower()
        return LONG_TEXT_BOUND if key in LONG_TEXT_NAMES else COMMAND_BOUND if key in COMMAND_NAMES else STRING_BOUND
    return max_string_length  # type: ignore[return-value]


def _prepare_schema(schema: dict, *, closed_objects: bool, max_string_length: int | str | None) -> dict:
    """A copy of `schema` tightened for generation (see the module docstring)."""
    schema = copy.deepcopy(schema)

    def visit(node: Any, in_allof: bool = False, name: str | None = None) -> None:
        """`name`: the property this schema is the value of (items and alternatives inherit it)."""
        if not isinstance(node, dict):
            return
        if (
            closed_objects
            and not in_allof
            and isinstance(node.get("properties"), dict)
            and not any(k in node for k in _OPEN_KEYS)
        ):
            node["additionalProperties"] = False
        bound = _string_bound(max_string_length, name)
        if (
            bound is not None
            and _is_string_schema(node)
            and not any(k in node for k in ("maxLength", "enum", "const", "pattern"))
        ):
            node["maxLength"] = bound
        for key in _SCHEMA_KEYS:
            sub = node.get(key)
            inherit = name if key in ("items", "additionalItems", "unevaluatedItems", "then", "else") else None
            if isinstance(sub, list):  # "items" as a list in older drafts
                for s in sub:
                    visit(s, name=inherit)
            else:
                visit(sub, name=inherit)
        for key in _SCHEMA_LIST_KEYS:
            if isinstance(node.get(key), list):
                for s in node[key]:
                    visit(s, in_allof=key == "allOf", name=name)
        for key in _SCHEMA_MAP_KEYS:
            if isinstance(node.get(key), dict):
                for k, s in node[key].items():
                    visit(s, name=k if key == "properties" else None)

    visit(schema)
    return schema


def _json_grammar(schema: dict, lenient: bool) -> str:
    """`%json {...}` for the lark grammar, with our JSON layout options."""
    s = dict(schema)
    options = dict(s.get("x-guidance") or {}, **_JSON_OPTIONS)
    if lenient:
        options["lenient"] = True
    s["x-guidance"] = options
    return "%json " + json.dumps(s, ensure_ascii=False)


def _lit(text: str) -> str:
    """A lark string literal."""
    return json.dumps(text, ensure_ascii=False)


# -- grammar ------------------------------------------------------------------------------


def _resolve(node: Any, root: dict) -> Any:
    """Follow a local "$ref" ("#/$defs/x") one step, for deciding a parameter's type."""
    if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/"):
        target: Any = root
        for part in node["$ref"][2:].split("/"):
            if not isinstance(target, dict):
                return node
            target = target.get(part.replace("~1", "/").replace("~0", "~"))
        return target if isinstance(target, dict) else node
    return node


def _xml_value_rule(rule: str, prop: Any, root: dict, lenient: bool, lines: list[str]) -> str:
    """Rules for one XML parameter value followed by "\\n</parameter>"; returns its name."""
    end = "\n</parameter>"
    node = _resolve(prop, root)
    node = node if isinstance(node, dict) else {}
    enum = node.get("enum")
    if "const" in node and isinstance(node["const"], str):
        enum = [node["const"]]
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        lines.append(f"{rule}: ({' | '.join(_lit(v) for v in enum)}) {_lit(end)}")
    elif node.get("type") == "string":
        lo, hi = node.get("minLength", 0), node.get("maxLength")
        lo = lo if isinstance(lo, int) else 0
        rep = f"{{{lo},{hi if isinstance(hi, int) else ''}}}"
        # A lazy lexeme: the shortest text that ends in "\n</parameter>".
        lines.append(f"{rule}[lazy]: /(?s:.){rep}\\n<\\/parameter>/")
    else:
        sub = prop if isinstance(prop, dict) else {}
        if "$ref" in json.dumps(sub):
            sub = dict(sub)
            for key in ("$defs", "definitions"):
                if key in root:
                    sub.setdefault(key, root[key])
        lines.append(f"{rule}: {_json_grammar(sub, lenient)} {_lit(end)}")
    return rule


def _tool_rules(i: int, name: str, schema: dict, fmt: str, lenient: bool, lines: list[str]) -> str:
    """The rule for one tool's call body, `{"name": ..., "arguments": ...}` or `<function=...>`."""
    rule = f"tool_{i}"
    if fmt == "json":
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        lines.append(f"{rule}: {_lit(head)} {_json_grammar(schema, lenient)} {_lit('}')}")
        return rule
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or [])
    parts = []
    for j, (key, prop) in enumerate(props.items()):
        value = _xml_value_rule(f"{rule}_v{j}", prop, schema, lenient, lines)
        lines.append(f"{rule}_p{j}: {_lit(f'<parameter={key}>' + chr(10))} {value} {_lit(chr(10))}")
        parts.append(f"{rule}_p{j}" + ("" if key in required else "?"))
    head = f"<function={name}>\n"
    lines.append(f"{rule}: {_lit(head)} {' '.join(parts)} {_lit('</function>')}")
    return rule


def _marker(text: str, token_id: int | None) -> str:
    """The marker as its own token where the tokenizer has one, or spelled out as text."""
    if token_id is None:
        return _lit(text)
    return f"(<[{token_id}]> | {_lit(text)})"


def build_grammar(
    schemas: list[tuple[str, dict, bool]],
    *,
    fmt: str,
    start: str,
    end: str,
    with_start: bool,
    parallel: bool,
    start_id: int | None = None,
    end_id: int | None = None,
) -> str:
    """The lark grammar for a call to one of the tools, given as (name, parameters schema,
    lenient); with_start=False: what follows the start marker."""
    rules: list[str] = []
    names = [_tool_rules(i, name, schema, fmt, lenient, rules) for i, (name, schema, lenient) in enumerate(schemas)]
    tail = f'"\\n" body "\\n" {_marker(end, end_id)}'
    if with_start:
        top = ['start: call ("\\n" call)*' if parallel else "start: call", f"call: {_marker(start, start_id)} {tail}"]
    else:
        top = [f"start: {tail}"]
    top.append(f"body: {' | '.join(names)}")
    return "\n".join(["%llguidance {}", *top, *rules]) + "\n"


# -- the constraint -----------------------------------------------------------------------

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer) -> Any:
    """llguidance's view of an engine Tokenizer, built once per tokenizer (~1 s for Qwen3)."""
    with _tokenizers_lock:
        lt = _tokenizers.get(tokenizer)
        if lt is None:
            eos = sorted(tokenizer.eos_token_ids) or None
            lt = _llg().LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size, eos_token=eos)
            _tokenizers[tokenizer] = lt
        return lt


def _allowed(matcher, bits: np.ndarray, n: int, what: str) -> np.ndarray:
    """The matcher's allowed-token mask over the first `n` ids, as booleans (`bits`: its buffer)."""
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if matcher.is_error():
        raise RuntimeError(f"{what} constraint failed: {matcher.get_error()}")
    return np.unpackbits(bits.view(np.uint8), bitorder="little", count=n).view(bool)


class ToolCallConstraint:
    """The Constraint (engine/runtime/constrain.py) for one generation."""

    def __init__(
        self,
        lt,
        matchers: dict[str, Any],
        mode: str,
        start: str,
        start_id: int | None,
        fmt: str = "json",
        closers: dict[str, list[list[int]]] | None = None,
        budget: int | None = None,
        eos: tuple[int, ...] = (),
        values: list[list[int]] | None = None,
        end_id: int | None = None,
    ):
        self._lt = lt
        self._templates = matchers  # "call": whole call(s) (required), "body": after the start marker
        self._mode = mode
        self._start = start.encode("utf-8")
        self._start_id = start_id
        self._end_id = end_id
        self._fmt = fmt
        self._closers = closers or {}  # see finish(); built per tokenizer by the factory
        self._n = lt.vocab_size
        self._bits = np.zeros((self._n + 31) // 32, dtype=np.int32)
        self._tail = b""  # recent free text, to find a marker spelled in pieces
        self._matcher = None
        self._done = False
        self._finishing = False
        self._forced: list[int] = []  # the closer being written (finish())
        self._call = b""  # the text of the call so far (finish() needs to know if it is in a string)
        self._budget = budget  # tokens the whole reply may have (None: no limit here)
        self._eos = [t for t in eos if t < self._n]
        self._values = values or []  # short values, for the closing simulation (see _closing_cost)
        self._used = 0  # tokens accepted so far
        self._call_start = 0  # self._used when the open call began
        self._shortest = 0  # tokens the shortest complete call took (0: none yet)
        if mode == "required":
            self._matcher = self._new_matcher("call")

    def _new_matcher(self, which: str):
        self._call = b""
        return self._templates[which].deep_copy()

    @property
    def in_call(self) -> bool:
        """A call is under way that finish() can still close: never at or past the budget."""
        if self._budget is not None and self._used >= self._budget:
            return False
        return self._matcher is not None

    @property
    def left(self) -> int | None:
        """Tokens the budget has left for the next choice (None: no budget)."""
        return None if self._budget is None else self._budget - self._used

    def finish(self) -> None:
        """Close the call that is under way as soon as the grammar allows (the generation loop
        calls this at max_tokens inside a call). From now on, whenever one of the format's
        closers (a quote inside a JSON string; else "}", "]", "," (ends a number that a required
        key must follow), then "\n" and the end marker;
        for XML "\n</parameter>\n", "</function>", then "\n" and the end marker, then the
        JSON closers inside a non-string parameter's value) can come
        next, it is forced; where none can (a required key, a value, a minLength), the model
        picks among what the grammar allows. Each forced closer ends a string, object, array,
        parameter or the call, and the grammar bounds everything else, so the call completes in
        a few tokens: the shortest completion is not searched for, only approached greedily.
        A no-op outside a call; further calls (tools mode) are not affected."""
        if self._matcher is not None:
            self._finishing = True

    @staticmethod
    def _in_json_string(text: bytes) -> bool:
        inside = escape = False
        for b in text:
            if escape:
                escape = False
            elif inside and b == 0x5C:  # backslash
                escape = True
            elif b == 0x22:  # quote
                inside = not inside
        return inside

    def _closer(self, matcher=None, call: bytes | None = None) -> list[int] | None:
        """The first closer the grammar accepts whole from here (or from `matcher` having read
        `call`), or None."""
        matcher = self._matcher if matcher is None else matcher
        call = self._call if call is None else call
        if self._fmt == "json":
            order = self._closers.get("string" if self._in_json_string(call) else "json", [])
        else:  # a JSON value sits after the last "<parameter=KEY>\n"; a raw one closes with the first closer
            at = call.rfind(b"<parameter=")
            value = call[call.find(b">\n", at) + 2 :] if at >= 0 else b""
            order = (
                self._closers.get("xml", [])
                + self._closers.get("string" if self._in_json_string(value) else "json", [])[:3]
            )
        for ids in order:
            if ids and matcher.validate_tokens(ids) == len(ids):
                return list(ids)
        return None

    def _closing_cost(self, limit: int) -> int:
        """About how many tokens finish() needs from here to close the open call: finish()'s
        own choices played out on a copy of the grammar's state (a closer where one fits, else
        the grammar's forced tokens, else the shortest value that fits). `limit` when it takes
        that many or more, or when no choice is found."""
        m = self._matcher.deep_copy()
        call, n = self._call, 0
        while n < limit:
            if m.is_stopped() or (m.is_accepting() and self._mode == "required") or self._closed(m):
                return n
            ids = (
                self._closer(m, call)
                or list(m.compute_ff_tokens())
                or next((v for v in self._values if m.validate_tokens(v) == len(v)), None)
                or self._any_token(m)
            )
            if not ids or not m.consume_tokens(ids) or m.is_error():
                return limit
            call += self._lt.decode_bytes(ids)
            n += len(ids)
        return limit

    def _any_token(self, matcher) -> list[int]:
        """The lowest token id the grammar allows (a last resort for the simulation)."""
        bits = np.zeros_like(self._bits)
        allowed = np.flatnonzero(_allowed(matcher, bits, self._n, "tool-call"))
        return [int(allowed[0])] if allowed.size else []

    def _closed(self, matcher) -> bool:
        """In tools mode: the call's grammar is complete (its end marker read)."""
        return self._mode == "tools" and matcher.is_accepting()

    def _budget_mask(self, mask: np.ndarray) -> np.ndarray:
        """The mask under the budget: finish() started when closing the call needs what is
        left; between parallel calls in required mode, only the end when another call would
        not fit; the start marker's token refused when no call would fit."""
        left = self._budget - self._used
        if self._matcher is None:
            if self._start_id is not None and self._shortest and left <= self._shortest and not self._done:
                mask = mask.copy() if mask is not None else np.ones(self._n, dtype=bool)
                mask[self._start_id] = False
            return mask
        if self._mode == "required" and self._matcher.is_accepting() and self._eos:
            if not self._shortest or left <= self._shortest + 1:
                ends = np.zeros(self._n, dtype=bool)
                ends[self._eos] = mask[self._eos]
                if ends.any():
                    return ends
            return mask
        if not self._finishing and left <= FINISH_WINDOW:
            cost = self._closing_cost(left + 1)
            if cost + 1 + cost // 8 >= left:  # (a model may take more tokens than the shortest spelling)
                self._finishing = True
        return mask

    def _as_token(self, mask: np.ndarray) -> np.ndarray:
        """Where a marker may come as its one token, only that token: spelled out in pieces it is
        the same marker in up to a dozen tokens, which a budget cannot count on."""
        for tid in (self._end_id, self._start_id if self._mode == "required" else None):
            if tid is not None and mask[tid]:
                only = np.zeros(self._n, dtype=bool)
                only[tid] = True
                return only
        return mask

    def allowed(self) -> np.ndarray | None:
        if self._budget is not None:
            base = (
                None
                if self._matcher is None
                else self._as_token(_allowed(self._matcher, self._bits, self._n, "tool-call"))
            )
            mask = self._budget_mask(base)
            if self._matcher is None:
                return mask
            return self._finish_mask(mask)
        if self._matcher is None:
            return None
        return self._finish_mask(_allowed(self._matcher, self._bits, self._n, "tool-call"))

    def _finish_mask(self, mask: np.ndarray) -> np.ndarray:
        """While finishing: the next closer (or the start marker as its one token) is the only
        token allowed where one can come."""
        if self._finishing:
            if not self._forced or not mask[self._forced[0]]:
                marker = [self._start_id] if self._start_id is not None and mask[self._start_id] else []
                self._forced = self._closer() or marker
            if self._forced and mask[self._forced[0]]:
                only = np.zeros(self._n, dtype=bool)
                only[self._forced[0]] = True
                return only
        return mask

    def accept(self, token: int) -> None:
        token = int(token)
        self._used += 1
        if self._matcher is not None:
            if not self._matcher.consume_token(token):
                raise RuntimeError(f"tool-call constraint: token {token} not allowed: {self._matcher.get_error()}")
            if self._forced and self._forced[0] == token:
                self._forced.pop(0)
            else:
                self._forced = []
            if token < self._n:
                self._call += self._lt.decode_bytes([token])
            if self._mode == "required" and self._matcher.is_accepting() and not self._matcher.is_stopped():
                self._call_done()
            if self._matcher.is_stopped():
                if self._mode == "tools":
                    self._call_done()
                self._matcher = None
                self._tail = b""
                self._finishing = False
                self._forced = []
                if self._mode == "required":
                    self._done = True
            return
        if self._done or token >= self._n:
            return
        if token == self._start_id:
            self._matcher = self._new_matcher("body")
            self._call_start = self._used - 1
            return
        self._tail += self._lt.decode_bytes([token])
        at = self._tail.find(self._start)
        if at < 0:
            self._tail = self._tail[-(len(self._start) - 1) :] if len(self._start) > 1 else b""
            return
        # The marker was spelled in pieces; the token may have run past its end.
        rest = self._tail[at + len(self._start) :]
        self._tail = b""
        matcher = self._new_matcher("body")
        if rest and not matcher.consume_tokens(self._lt.tokenize_bytes(rest)):
            return  # text after the marker that no call can continue: leave it unconstrained
        self._call = rest
        self._matcher = matcher
        self._call_start = self._used - 1

    def _call_done(self) -> None:
        """A call just completed: remember what the shortest one took, and start the next count."""
        took = self._used - self._call_start
        self._shortest = took if not self._shortest else min(self._shortest, took)
        self._call_start = self._used
        self._finishing = False
        self._forced = []

    def done(self) -> bool:
        return self._done


class ToolCallConstraintFactory:
    """`make(tokenizer) -> ToolCallConstraint`, as GenerationRequest.constraint wants it.

    The tools, grammar and options are checked here, once; the per-tokenizer grammar (which
    names the marker tokens by id) is built on first use and cached.
    """

    def __init__(
        self,
        tools: list[dict],
        mode: str = "required",
        fmt: str = "json",
        start: str = "<tool_call>",
        end: str = "</tool_call>",
        *,
        parallel: bool = False,
        closed_objects: bool = True,
        max_string_length: int | str | None = "auto",
        budget: int | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if not start or not end:
            raise ValueError("the start and end markers must not be empty")
        if (
            max_string_length != "auto"
            and max_string_length is not None
            and (not isinstance(max_string_length, int) or max_string_length < 0)
        ):
            raise ValueError(f"max_string_length must be 'auto', None or an int >= 0, got {max_string_length!r}")
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive int or None, got {budget!r}")
        self.mode, self.fmt, self.start, self.end, self.parallel = mode, fmt, start, end, parallel
        self.budget = budget
        self.warnings: list[str] = []
        self.schemas: list[tuple[str, dict, bool]] = []  # (name, parameters, lenient)
        llg = _llg()
        for name, params in _normalise_tools(tools):
            schema = _prepare_schema(params, closed_objects=closed_objects, max_string_length=max_string_length)
            for lenient in (False, True):
                g = build_grammar(
                    [(name, schema, lenient)], fmt=fmt, start=start, end=end, with_start=True, parallel=False
                )
                is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(llg.LLMatcher.grammar_from_lark(g))
                if not is_error:
                    if lenient:
                        self.warnings.append(f"tool {name!r}: unsupported schema keywords are ignored")
                    self.warnings += [f"tool {name!r}: {m}" for m in messages]
                    self.schemas.append((name, schema, lenient))
                    break
                if lenient:
                    raise ValueError(
                        f"tool {name!r}: cannot build a grammar for its parameters: "
                        f"{messages[0] if messages else 'unknown error'}"
                    )
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def matchers(self, tokenizer) -> tuple[Any, dict[str, Any], int | None]:
        """llguidance's tokenizer, fresh matchers for "call" (from the start marker) and
        "body" (after it), the start marker's token id, the closers (_closers) and the end marker's
        token id; each generation copies the matchers, which is cheap (microseconds, against
        milliseconds to build one)."""
        with self._lock:
            hit = self._cache.get(tokenizer)
            if hit is None:
                lt = ll_tokenizer(tokenizer)
                start_id = self._marker_id(lt, tokenizer, self.start)
                end_id = self._marker_id(lt, tokenizer, self.end)
                kw = {
                    "fmt": self.fmt,
                    "start": self.start,
                    "end": self.end,
                    "parallel": self.parallel,
                    "start_id": start_id,
                    "end_id": end_id,
                }
                llg = _llg()
                matchers = {}
                for which in ("call", "body"):
                    g = llg.LLMatcher.grammar_from_lark(build_grammar(self.schemas, with_start=which == "call", **kw))
                    m = llg.LLMatcher(lt, g, log_level=0)
                    if m.is_error():
                        raise ValueError(f"tool-call grammar rejected: {m.get_error()}")
                    matchers[which] = m
                hit = (lt, matchers, start_id, self._closers(lt, end_id), end_id)
                self._cache[tokenizer] = hit
            return hit

    def _closers(self, lt, end_id: int | None) -> dict[str, list[list[int]]]:
        """Token ids of the texts ToolCallConstraint.finish() forces, in order of preference:
        "string" inside a JSON string, "json" outside one, "xml" for the XML format."""
        end = [end_id] if end_id is not None else lt.tokenize_bytes(self.end.encode("utf-8"))
        ids = lambda text: list(lt.tokenize_bytes(text.encode("utf-8")))  # noqa: E731
        close = [ids("\n") + end, end]
        return {
            "string": [ids('"')],
            "json": [ids("}"), ids("]"), ids(","), *close],
            "xml": [ids("\n</parameter>\n"), ids("</function>"), *close],
            # short values, for the closing simulation where a value must come
            "values": [
                ids('""'),
                ids("0"),
                ids("false"),
                ids("null"),
                ids("[]"),
                ids("{}"),
                ids('"'),
                ids("0\n</parameter>\n"),
            ],
        }

    @staticmethod
    def _marker_id(lt, tokenizer, text: str) -> int | None:
        """The id of a token that is exactly the marker and that llguidance treats as special
        (added tokens are), or None: then the marker is matched as text."""
        tid = tokenizer.token_to_id(text)
        if tid is None or tid >= lt.vocab_size or not lt.is_special_token(tid):
            return None
        return tid

    def with_budget(self, budget: int | None) -> ToolCallConstraintFactory:
        """This factory for replies of at most `budget` tokens: the same tools, grammars and
        per-tokenizer matchers (built once, shared), so a server that sees the same tools on
        every request builds them once."""
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive int or None, got {budget!r}")
        other = copy.copy(self)
        other.budget = budget
        return other

    def __call__(self, tokenizer) -> ToolCallConstraint:
        lt, matchers, start_id, closers, end_id = self.matchers(tokenizer)
        return ToolCallConstraint(
            lt,
            matchers,
            self.mode,
            self.start,
            start_id,
            self.fmt,
            closers,
            budget=self.budget,
            eos=tuple(sorted(tokenizer.eos_token_ids)),
            values=closers.get("values"),
            end_id=end_id,
        )


def tool_call_constraint(
    tools: list[dict],
    mode: str = "required",
    fmt: str = "json",
    start: str = "<tool_call>",
    end: str = "</tool_call>",
    **options,
) -> ToolCallConstraintFactory:
    """A ConstraintFactory for GenerationRequest.constraint (see the module docstring).

    options: parallel (bool, "required" mode: allow more than one call), closed_objects (bool),
    max_string_length ("auto" (default), int or None), budget (int: the reply's hard token limit).
    """
    return ToolCallConstraintFactory(tools, mode, fmt, start, end, **options)


# -- a whole reply as JSON (the server's response_format) ------------------------------------


class JsonConstraint:
    """The Constraint for a reply that must be one JSON value matching a schema: every token is
    constrained from the first, and the reply ends (done()) when the value is complete."""

    def __init__(self, lt, matcher):
        self._lt, self._matcher = lt, matcher
        self._n = lt.vocab_size
        self._bits = np.zeros((self._n + 31) // 32, dtype=np.int32)
        self._done = False

    def allowed(self) -> np.ndarray | None:
        if self._done:
            return None
        return _allowed(self._matcher, self._bits, self._n, "JSON")

    def accept(self, token: int) -> None:
        if self._done:
            return
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"JSON constraint: token {token} not allowed: {self._matcher.get_error()}")
        self._done = self._matcher.is_stopped()

    def done(self) -> bool:
        return self._done


class JsonConstraintFactory:
    """`make(tokenizer) -> JsonConstraint` for a JSON Schema (None: any JSON object). The schema
    is checked here, once; strings without a bound get STRING_BOUND (as tool arguments do), so a
    model that never closes a string still ends with a value that validates."""

    def __init__(
        self, schema: dict | None = None, *, closed_objects: bool = False, max_string_length: int | str | None = "auto"
    ):
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise TypeError("a JSON Schema must be an object")
        self.schema = _prepare_schema(schema, closed_objects=closed_objects, max_string_length=max_string_length)
        llg = _llg()
        self._grammar = llg.LLMatcher.grammar_from_lark(
            f"%llguidance {{}}\nstart: value\nvalue: {_json_grammar(self.schema, False)}\n"
        )
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(self._grammar)
        if is_error:
            raise ValueError(f"cannot build a grammar for the schema: {messages[0] if messages else 'unknown error'}")
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def __call__(self, tokenizer) -> JsonConstraint:
        with self._lock:
            hit = self._cache.get(tokenizer)
            if hit is None:
                lt = ll_tokenizer(tokenizer)
                m = _llg().LLMatcher(lt, self._grammar, log_level=0)
                if m.is_error():
                    raise ValueError(f"JSON grammar rejected: {m.get_error()}")
                hit = self._cache[tokenizer] = (lt, m)
        lt, m = hit
        return JsonConstraint(lt, m.deep_copy())
