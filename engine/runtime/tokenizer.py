"""Tokenizer: the `tokenizers` library plus Hugging Face chat templates rendered with jinja2.

We deliberately avoid importing transformers: it is slow to import and heavy. The template
environment mirrors what transformers sets up so that model-provided templates render the same.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import jinja2.visitor
import regex
import tokenizers

from flashmoe.engine.errors import FlashMoEError, ModelLoadError
from flashmoe.engine.runtime.jsonfile import read_bytes

log = logging.getLogger("flashmoe")
# Stands in for control-token text inside messages when finding the template's own markers
# (a private-use character: no template treats it specially).
_FILLER = "\ue000"
# Past this many characters a text is encoded with the GIL released (tokenizers' batch call): a
# server's other threads (its event loop) keep running while a long prompt is encoded. Below it,
# the plain call is quicker.
_LONG_TEXT = 16384


def _encode(tok: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > _LONG_TEXT:
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tok.encode(text, add_special_tokens=add_special_tokens).ids


# Used when a model ships no template: plain ChatML, which most chat models understand.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTemplateError(jinja2.TemplateError, FlashMoEError):
    """A chat template refused the conversation (raise_exception) or failed while rendering."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's builtin tojson HTML-escapes <, >, & and ' which would corrupt prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some templates to mark assistant
    text for training masks); we only need it to parse, so it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# Bounds on what a chat template may do: a template is model-supplied code (a downloaded model, a
# GGUF's tokenizer.chat_template). The sandbox stops it reaching Python; these stop it spending
# unbounded time or memory: every loop iteration and call is a step, every string, list or number
# it builds and the text it renders are measured, and past a bound rendering stops with a
# ChatTemplateError (one line) instead of running past --timeout or handing the tokenizer a
# gigabyte to abort on.
MAX_TEMPLATE_STEPS = 5_000_000  # loop iterations and calls in one rendering (a real one takes thousands)
MAX_TEMPLATE_SECONDS = 5.0  # and the time they may take (macro calls are slow: 5 million would take 15 s)
MAX_TEMPLATE_CHARS = 32 << 20  # characters of any one value and of the rendered prompt
_NUMBER_BITS = 1 << 16  # an integer the template computes may have at most this many bits


class _Budget(threading.local):
    steps = MAX_TEMPLATE_STEPS
    deadline = float("inf")


_budget = _Budget()


def _step() -> None:
    _budget.steps -= 1
    if _budget.steps < 0:
        raise ChatTemplateError(
            f"the chat template ran more than {MAX_TEMPLATE_STEPS:,} steps (loop iterations and calls); it is refused"
        )
    if not _budget.steps & 1023 and time.monotonic() > _budget.deadline:
        raise ChatTemplateError(f"the chat template ran for more than {MAX_TEMPLATE_SECONDS:g} s; it is refused")


def _too_big(what: str) -> ChatTemplateError:
    return ChatTemplateError(
        f"the chat template built {what} of more than {MAX_TEMPLATE_CHARS:,} characters; it is refused"
    )


def _sized(value: Any) -> Any:
    """value, unless it is a string or sequence past MAX_TEMPLATE_CHARS or an integer past _NUMBER_BITS."""
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_TEMPLATE_CHARS:
        raise _too_big("a value")
    if isinstance(value, int) and value.bit_length() > _NUMBER_BITS:
        raise ChatTemplateError(
            f"the chat template computed a number of more than {_NUMBER_BITS:,} bits; it is refused"
        )
    return value


class _Counted:
    """A loop's iterable, counting a step per item (len() as the iterable's, for loop.length)."""

    __slots__ = ("_items",)

    def __init__(self, items: Any) -> None:
        self._items = items

    def __iter__(self):
        for item in self._items:
            _step()
            yield item

    def __len__(self) -> int:
        return len(self._items)


_WIDTH = re.compile(r"%[-#0 +]*(\d+)|\{[^{}]*?(\d{7,})[^{}]*\}")


def _check_widths(fmt: str) -> None:
    """A printf or str.format width wider than the bound (`'%1000000000s' % x`)."""
    for m in _WIDTH.finditer(fmt):
        if int(m.group(1) or m.group(2)) > MAX_TEMPLATE_CHARS:
            raise _too_big("a formatted string")


def _grows(obj: Any, name: str, args: tuple) -> None:
    """Refuse a string method call whose result would pass the bound, before it allocates."""
    if not isinstance(obj, str):
        return
    ints = [a for a in args if isinstance(a, int)]
    if name in ("ljust", "rjust", "center", "zfill") and ints and ints[0] > MAX_TEMPLATE_CHARS:
        raise _too_big("a padded string")
    if name == "expandtabs" and ints and len(obj) * max(1, ints[0]) > MAX_TEMPLATE_CHARS:
        raise _too_big("a string")
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        if (obj.count(args[0]) if args[0] else len(obj) + 1) * len(args[1]) + len(obj) > MAX_TEMPLATE_CHARS:
            raise _too_big("a string")
    if name in ("format", "format_map"):
        _check_widths(obj)


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with the bounds above: `*`, `+`, `%` and `**` are checked before and after,
    calls and loop items count as steps, `~` joins and risky filters are measured."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _step()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEMPLATE_CHARS:
                    raise _too_big("a repeated value")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * max(1, abs(left).bit_length()) > _NUMBER_BITS:
                raise ChatTemplateError(
                    f"the chat template computed a number of more than {_NUMBER_BITS:,} bits; it is refused"
                )
        elif operator == "%" and isinstance(left, str):
            _check_widths(left)
        return _sized(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _step()
        _grows(getattr(__obj, "__self__", None), getattr(__obj, "__name__", ""), args)
        return _sized(super().call(__context, __obj, *args, **kwargs))

    def _parse(self, source, name, filename):
        """The template's tree, with every loop's iterable counted and every `~` measured."""
        return _Bounds().visit(super()._parse(source, name, filename))


class _Bounds(jinja2.visitor.NodeTransformer):
    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = jinja2.nodes.Filter(node.iter, "flashmoe_counted", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return jinja2.nodes.Filter(node, "flashmoe_sized", [], [], None, None, lineno=node.lineno)


def _bounded_filter(fn, grows):
    def wrapper(*args, **kwargs):
        _step()
        grows(*args, **kwargs)
        return _sized(fn(*args, **kwargs))

    return wrapper


@jinja2.pass_context  # (a filter that takes the context is never run at compile time)
def _counted(context, items: Any) -> _Counted:
    return _Counted(items)


@jinja2.pass_context
def _sized_filter(context, value: Any) -> Any:
    return _sized(value)


def _no_check(*args: Any, **kwargs: Any) -> None:
    pass


def _center_check(value: Any, width: Any = 80, *args: Any) -> None:
    if isinstance(width, int) and width > MAX_TEMPLATE_CHARS:
        raise _too_big("a padded string")


def _indent_check(value: Any, width: Any = 4, *args: Any, **kwargs: Any) -> None:
    if isinstance(width, str):
        width = len(width)
    if isinstance(width, int) and width * (str(value).count("\n") + 1) + len(str(value)) > MAX_TEMPLATE_CHARS:
        raise _too_big("an indented string")


def _replace_check(value: Any, old: Any = "", new: Any = "", *args: Any) -> None:
    _grows(str(value), "replace", (str(old), str(new)))


def _format_check(value: Any, *args: Any, **kwargs: Any) -> None:
    _check_widths(str(value))


# Jinja's filters that can make a value bigger than what they were given, with the check each
# needs before it allocates (the result is measured after, as every call's is).
_GROWING_FILTERS = {
    "center": _center_check,
    "indent": _indent_check,
    "replace": _replace_check,
    "format": _format_check,
    "join": _no_check,
    "wordwrap": _no_check,
    "list": _no_check,
    "string": _no_check,
    "batch": _no_check,
    "slice": _no_check,
    "map": _no_check,
    "tojson": _no_check,
    "pprint": _no_check,
    "urlencode": _no_check,
    "xmlattr": _no_check,
}


def _bounded_filter(fn, check):
    @jinja2.pass_context
    def bounded(context, *args: Any, **kwargs: Any) -> Any:
        _step()
        check(*args, **kwargs)
        if jinja2.utils._PassArg.from_obj(fn) is jinja2.utils._PassArg.context:
            return _sized(fn(context, *args, **kwargs))
        if jinja2.utils._PassArg.from_obj(fn) is jinja2.utils._PassArg.eval_context:
            return _sized(fn(context.eval_ctx, *args, **kwargs))
        if jinja2.utils._PassArg.from_obj(fn) is jinja2.utils._PassArg.environment:
            return _sized(fn(context.environment, *args, **kwargs))
        return _sized(fn(*args, **kwargs))

    return bounded


class _BoundedTemplate(jinja2.Template):
    def render(self, *args: Any, **kwargs: Any) -> str:
        """The rendering, within the bounds: steps counted from zero, the text measured as it comes."""
        _budget.steps, _budget.deadline = MAX_TEMPLATE_STEPS, time.monotonic() + MAX_TEMPLATE_SECONDS
        out: list[str] = []
        size = 0
        try:
            for piece in self.generate(*args, **kwargs):
                size += len(piece)
                if size > MAX_TEMPLATE_CHARS:
                    raise _too_big("a prompt")
                out.append(piece)
        except RecursionError:
            raise ChatTemplateError(
                "the chat template calls itself too deeply (a macro or a recursive loop); it is refused"
            ) from None
        except MemoryError:
            raise ChatTemplateError("the chat template ran out of memory; it is refused") from None
        return "".join(out)


def _make_environment() -> jinja2.Environment:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.template_class = _BoundedTemplate
    env.filters["tojson"] = _tojson
    for name, check in _GROWING_FILTERS.items():
        env.filters[name] = _bounded_filter(env.filters[name], check)
    env.filters["flashmoe_counted"] = _counted
    env.filters["flashmoe_sized"] = _sized_filter
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when the file does not exist."""
    if not path.exists() and not path.is_symlink():
        return None
    raw = read_bytes(path)  # refuses a FIFO or a device instead of blocking on it
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(path, f"cannot read file: {e}") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(path, f"invalid JSON: {e}") from e
    except RecursionError:
        raise ModelLoadError(path, "invalid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: Path, key: str) -> str | None:
    """bos_token/eos_token are written either as a string or as {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ModelLoadError(path, f"{key} must be a string or an object with 'content'")


def _id_list(value: Any, path: Path) -> list[int]:
    """eos_token_id is an int, a list of ints, or null."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ModelLoadError(path, f"eos_token_id must be an int or a list of ints, got {value!r}")
    return values


class StreamingDetokenizer:
    """Turns token ids into text one at a time without splitting multi-byte characters.

    Decodes a short window of recent ids and emits the new part once it no longer ends in
    U+FFFD (an incomplete UTF-8 sequence). Decoding a window starting at `_prefix` rather
    than only the new ids keeps decoders that look at neighbours (e.g. sentencepiece's
    leading space) consistent with a whole-sequence decode.

    tokenizers.decoders.DecodeStream does the same but has no flush, so a trailing
    incomplete character would be lost; hence this small implementation.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: ids before it are fully emitted and no longer decoded
        self._read = 0  # ids before it have been emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        if len(now) <= len(done) or now.endswith("\ufffd"):
            return ""  # nothing new yet, or a character is still incomplete
        new = now[len(done) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += new
        return new

    def flush(self) -> str:
        """Emit whatever is pending (an incomplete character comes out as U+FFFD)."""
        done = self._decode(self._ids[self._prefix : self._read])
        now = self._decode(self._ids[self._prefix :])
        new = now[len(done) :]
        self._prefix = self._read = len(self._ids)
        self.text += new
        return new


class Tokenizer:
    """A model's tokenizer and chat template, loaded from its folder."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        chat_templates: dict[str, jinja2.Template] | None = None,
    ):
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.has_chat_template = bool(chat_templates)
        if not chat_templates:
            chat_templates = {"default": _make_environment().from_string(FALLBACK_CHAT_TEMPLATE)}
        self._templates = chat_templates
        self.template_source = ""  # the chat template's text, when the folder has one
        self._guarded: list[str] | None = None
        self._as_text: tokenizers.Tokenizer | None = None

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise ModelLoadError(folder, "not a directory")

        tok_file = folder / "tokenizer.json"
        if not tok_file.exists() and not tok_file.is_symlink():
            raise ModelLoadError(tok_file, "missing (every model folder needs tokenizer.json)")
        _read_json(tok_file)  # gives a clear "invalid JSON" before tokenizers' terser message
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises plain Exception subclasses
            raise ModelLoadError(tok_file, f"cannot load tokenizer: {e}") from e

        cfg_file = folder / "tokenizer_config.json"
        cfg = _read_json(cfg_file) or {}
        bos_token = _token_content(cfg.get("bos_token"), cfg_file, "bos_token")
        eos_token = _token_content(cfg.get("eos_token"), cfg_file, "eos_token")

        eos_ids: set[int] = set()
        if eos_token is not None:
            eos_id = tok.token_to_id(eos_token)
            if eos_id is None:
                raise ModelLoadError(cfg_file, f"eos_token {eos_token!r} is not in the vocabulary")
            eos_ids.add(eos_id)
        config_file = folder / "config.json"
        config = _read_json(config_file) or {}
        eos_ids.update(_id_list(config.get("eos_token_id"), config_file))
        text_config = config.get("text_config")  # multimodal configs nest the language model
        if isinstance(text_config, dict):
            eos_ids.update(_id_list(text_config.get("eos_token_id"), config_file))
        gen_file = folder / "generation_config.json"
        gen = _read_json(gen_file) or {}
        eos_ids.update(_id_list(gen.get("eos_token_id"), gen_file))

        templates = cls._load_templates(folder, cfg)
        out = cls(
            tok, bos_token=bos_token, eos_token=eos_token, eos_token_ids=frozenset(eos_ids), chat_templates=templates
        )
        out.template_source = getattr(templates.get("tool_use") or templates.get("default"), "flashmoe_source", "")
        return out

    @staticmethod
    def _load_templates(folder: Path, cfg: dict) -> dict[str, jinja2.Template]:
        """Compile every template the folder provides, keyed by name ("default", "tool_use", ...).

        Compiling at load time means a broken template fails here, naming its file,
        instead of in the middle of a chat.
        """
        cfg_file = folder / "tokenizer_config.json"
        sources: dict[str, tuple[str, Path]] = {}
        raw = cfg.get("chat_template")
        if isinstance(raw, str):
            sources["default"] = (raw, cfg_file)
        elif isinstance(raw, list):
            for entry in raw:
                if not (
                    isinstance(entry, dict)
                    and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)
                ):
                    raise ModelLoadError(cfg_file, "chat_template list entries need 'name' and 'template' strings")
                sources[entry["name"]] = (entry["template"], cfg_file)
        elif raw is not None:
            raise ModelLoadError(cfg_file, "chat_template must be a string or a list of {name, template}")

        # Newer exports keep the template outside tokenizer_config.json; that copy wins.
        json_file = folder / "chat_template.json"
        data = _read_json(json_file)
        if data is not None:
            if not isinstance(data.get("chat_template"), str):
                raise ModelLoadError(json_file, "expected a string 'chat_template'")
            sources["default"] = (data["chat_template"], json_file)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.exists() or jinja_file.is_symlink():
            try:
                sources["default"] = (read_bytes(jinja_file).decode("utf-8"), jinja_file)
            except UnicodeDecodeError as e:
                raise ModelLoadError(jinja_file, f"cannot read file: {e}") from e

        if sources and "default" not in sources:
            raise ModelLoadError(cfg_file, "chat_template list has no template named 'default'")
        env = _make_environment()
        templates = {}
        for name, (source, file) in sources.items():
            try:
                templates[name] = env.from_string(source)
                templates[name].flashmoe_source = source  # tool-call format sniffing reads it
            except jinja2.TemplateSyntaxError as e:
                raise ModelLoadError(
                    file, f"chat template {name!r} does not parse: {e.message} (line {e.lineno})"
                ) from e
        return templates

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return _encode(self._tok, text, add_special_tokens)

    def count(self, text: str) -> int:
        """How many tokens `text` encodes to, with no list of ids made (turning millions of ids
        into a Python list holds the GIL for a tenth of a second and more)."""
        return len(self._tok.encode_batch([text], add_special_tokens=False)[0])

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token can stand for (the longest vocabulary entry: a byte-level
        entry has a character per byte, more than the text it decodes to). A text of more than
        `n * longest_token_chars` characters is more than n tokens, known without encoding it."""
        return max((len(k) for k in self._tok.get_vocab(with_added_tokens=True)), default=1) or 1

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json text (for libraries that build their own view of the vocabulary)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> str:
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        variables = dict(template_kwargs)
        variables.update(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            # "" rather than None so templates doing `bos_token + ...` still work.
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        try:
            return self._templates[name].render(**variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template {name!r} failed: {e}") from e

    # -- prompts whose content holds control-token text ---------------------------------------

    def _guarded_tokens(self) -> list[str]:
        """Added tokens that content must not produce: every special one, and the others that the
        chat template never writes itself (those it writes, like <tool_call> or </think>, a
        template may look for in content, so they keep their meaning there)."""
        if self._guarded is None:
            source = (
                self.template_source
                or "".join(getattr(t, "flashmoe_source", "") for t in self._templates.values())
                or FALLBACK_CHAT_TEMPLATE
            )
            added = self._tok.get_added_tokens_decoder().values()
            self._guarded = sorted(
                {t.content for t in added if t.content and (t.special or t.content not in source)},
                key=len,
                reverse=True,
            )
        return self._guarded

    def _text_tokenizer(self) -> tokenizers.Tokenizer:
        """A copy of the tokenizer that encodes every guarded token's text as plain text."""
        if self._as_text is None:
            guarded = set(self._guarded_tokens())
            data = json.loads(self._tok.to_str())
            for entry in data.get("added_tokens") or []:
                if entry.get("content") in guarded:
                    entry["special"] = True
            tok = tokenizers.Tokenizer.from_str(json.dumps(data))
            tok.encode_special_tokens = True
            self._as_text = tok
        return self._as_text

    def encode_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> list[int]:
        """The chat template's prompt as token ids (see render_chat)."""
        return self.render_chat(messages, tools, add_generation_prompt, **template_kwargs)[0]

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> tuple[list[int], str]:
        """The chat template's prompt as token ids, where only the template's own markers are
        control tokens: `<|im_end|>` written inside a message or a tool result is text.

        Found by rendering twice: once as is, once with every guarded token's text in the
        messages replaced by filler of the same length, so the second rendering has control tokens
        exactly where the template put them. The text between them is encoded with the guarded
        tokens as text. Without guarded text in the messages (the usual case) this is a plain
        encode of the rendering."""
        text = self.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return self._encode_rendered(text, messages, tools, add_generation_prompt, template_kwargs), text

    def _encode_rendered(self, text: str, messages, tools, add_generation_prompt, template_kwargs) -> list[int]:
        guarded = self._guarded_tokens()
        if not guarded:
            return self.encode(text)
        # (regex, not re: matched with the GIL let go, a server's event loop runs on while a long
        # prompt is scanned; a text of '<' alone costs re a try of every token at each character)
        pattern = regex.compile("|".join(regex.escape(t) for t in guarded))
        found = False

        def scrub(value: Any) -> Any:
            nonlocal found
            if isinstance(value, str):
                out = pattern.sub(lambda m: _FILLER * len(m.group(0)), value, concurrent=True)
                found = found or out != value
                return out
            if isinstance(value, dict):
                return {k: scrub(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [scrub(v) for v in value]
            return value

        clean_messages, clean_tools = scrub(messages), scrub(tools)
        if not found:
            return self.encode(text)
        clean = self.apply_chat_template(
            clean_messages, tools=clean_tools, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        markers = [m.span() for m in pattern.finditer(clean, concurrent=True)]
        if len(clean) != len(text) or any(text[a:b] != clean[a:b] for a, b in markers):
            # The template did something length-changing with content; no way to line the two up.
            log.warning(
                "flashmoe: warning: the prompt holds control-token text inside a message and the chat "
                "template could not be lined up; it is encoded as written"
            )
            return self.encode(text)
        as_text = self._text_tokenizer()
        ids: list[int] = []
        pos = 0
        for a, b in markers:
            if a > pos:
                ids += _encode(as_text, text[pos:a], False)
            ids += self._tok.encode(text[a:b], add_special_tokens=False).ids
            pos = b
        if pos < len(text):
            ids += _encode(as_text, text[pos:], False)
        return ids

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self._tok, skip_special_tokens=skip_special_tokens)
