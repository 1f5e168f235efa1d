"""Issue 41, items 14 and 15: model files that try to exhaust memory or time. A GGUF whose counts
claim more than the file holds, or that is malformed in other ways, is one line (exit 3 through
the CLI), never a traceback or unbounded memory; a chat template is bounded in the steps it runs
and the text it renders, so a hostile one fails in seconds instead of running past --timeout or
aborting the tokenizer with a gigabyte of text.
"""

from __future__ import annotations

import struct
import threading
import time

import pytest

from tests.helpers.cli import run_cli

# ---- GGUF: a tiny well-formed file, then every way of breaking it ----------------------------------

UINT32, STRING, ARRAY, UINT64 = 4, 8, 9, 10


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + payload


def string_array(items) -> bytes:
    return struct.pack("<IQ", STRING, len(items)) + b"".join(s(t) for t in items)


def gguf(kvs=None, tensors=None, data=b"\0" * 64, version=3, counts=None) -> bytes:
    """A GGUF file: header, key/values, tensor table, 32-aligned data."""
    kvs = (
        kvs
        if kvs is not None
        else [
            kv("general.architecture", STRING, s("llama")),
            kv("tokenizer.ggml.tokens", ARRAY, string_array(["a", "b"])),
        ]
    )
    tensors = tensors if tensors is not None else [s("token_embd.weight") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0)]
    n_tensors, n_kvs = counts if counts is not None else (len(tensors), len(kvs))
    body = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kvs) + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + data


MALFORMED = {
    "empty": b"",
    "no magic": b"GGML" + gguf()[4:],
    "version 99": gguf(version=99),
    "truncated header": gguf()[:20],
    "truncated in a key": gguf()[:40],
    "array count 2**62": gguf(
        kvs=[
            kv("general.architecture", STRING, s("llama")),
            kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", UINT32, 1 << 62)),
        ]
    ),
    "byte array count 2**62": gguf(
        kvs=[
            kv("general.architecture", STRING, s("llama")),
            kv("tokenizer.ggml.merges", ARRAY, struct.pack("<IQ", 0, 1 << 62)),
        ]
    ),
    "string array count 2**62": gguf(kvs=[kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 1 << 62))]),
    "string length 2**63": gguf(kvs=[kv("general.architecture", STRING, struct.pack("<Q", 1 << 63))]),
    "key count 2**60": gguf(counts=(1, 1 << 60)),
    "tensor count 2**60": gguf(counts=(1 << 60, 2)),
    "unknown value type": gguf(kvs=[kv("general.architecture", 99, b"\0" * 8)]),
    "unknown array type": gguf(kvs=[kv("x", ARRAY, struct.pack("<IQ", 77, 3))]),
    "arrays nested 1000 deep": gguf(
        kvs=[kv("x", ARRAY, struct.pack("<IQ", ARRAY, 1) * 1000 + struct.pack("<IQ", UINT32, 0))]
    ),
    "duplicate key": gguf(kvs=[kv("general.architecture", STRING, s("llama"))] * 2),
    "alignment 3": gguf(kvs=[kv("general.alignment", UINT32, struct.pack("<I", 3))]),
    "alignment a string": gguf(kvs=[kv("general.alignment", STRING, s("32"))]),
    "tensor with 1000 dims": gguf(
        tensors=[s("t") + struct.pack("<I", 1000) + struct.pack("<Q", 1) * 1000 + struct.pack("<IQ", 0, 0)]
    ),
    "tensor of 2**62 elements": gguf(tensors=[s("t") + struct.pack("<IQQIQ", 2, 1 << 31, 1 << 31, 0, 0)]),
    "tensor past the end": gguf(tensors=[s("t") + struct.pack("<IQQIQ", 2, 4, 2, 0, 1 << 40)]),
    "unknown tensor type": gguf(tensors=[s("t") + struct.pack("<IQQIQ", 2, 4, 2, 200, 0)]),
    "duplicate tensor": gguf(tensors=[s("t") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0)] * 2),
    "tensor name not UTF-8": gguf(tensors=[s(b"\xff\xfe") + struct.pack("<IQQIQ", 2, 4, 2, 0, 0)]),
    "tokens not strings": gguf(
        kvs=[
            kv("general.architecture", STRING, s("llama")),
            kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", UINT32, 2) + b"\0" * 8),
        ]
    ),
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_gguf_is_one_line(tmp_path, kind):
    from flashmoe.engine.formats.gguf_import import gguf_to_hf_folder

    path = tmp_path / "bad.gguf"
    path.write_bytes(MALFORMED[kind])
    box: dict = {}

    def work():
        try:
            gguf_to_hf_folder(path, tmp_path / "out")
        except BaseException as e:  # noqa: BLE001 - the test checks which
            box["error"] = e

    t = threading.Thread(target=work, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(20)
    assert not t.is_alive(), f"reading the GGUF ran for {time.monotonic() - start:.0f} s"
    e = box.get("error")
    assert type(e) is ValueError, repr(e)
    assert "\n" not in str(e) and str(e), str(e)


@pytest.mark.parametrize("kind", ["array count 2**62", "duplicate key", "tensor past the end", "empty"])
def test_a_malformed_gguf_through_convert_is_exit_3(tmp_path, kind):
    path = tmp_path / "bad.gguf"
    path.write_bytes(MALFORMED[kind])
    r = run_cli("convert", path, tmp_path / "out", timeout=120)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("flashmoe: error: ") and str(path) in lines[-1], lines


def test_the_well_formed_base_passes_the_structure_check(tmp_path):
    from flashmoe.engine.formats.gguf_import import check_structure

    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf())
    check_structure(path)


# ---- chat templates: bounded in steps and in what they render ---------------------------------------

HOSTILE_TEMPLATES = {
    "10**10 loop steps": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x",
    "nested loops with a body": "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "recursive macro": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "branching macro": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "recursive loop": "{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}",
    "1 GB by multiplication": "{{ 'a' * 1000000000 }}",
    "1 GB of output": "{% for i in range(100000) %}{{ 'a' * 20000 }}{% endfor %}",
    "doubling by concatenation": (
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}"
    ),
    "doubling by addition": (
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s|length }}"
    ),
    "a list multiplied": "{{ ([1] * 1000000000)|length }}",
    "a huge power": "{{ (7 ** 100000000) % 10 }}",
    "a wide format": "{{ '%1000000000s' % 'a' }}",
    "center": "{{ 'a'|center(1000000000) }}",
    "a wide ljust": "{{ 'a'.ljust(1000000000) }}",
    "indent": "{% set ns = namespace(s='a\n' * 100000) %}{{ ns.s|indent(100000) }}",
    "replace": "{% set x = 'a' * 100000 %}{{ x.replace('a', 'b' * 100000) }}",
    "a wide str.format": "{{ '{:>1000000000}'.format(1) }}",
}


@pytest.mark.parametrize("kind", list(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_fails_in_seconds(kind):
    from flashmoe.engine.runtime.tokenizer import ChatTemplateError, _make_environment

    template = _make_environment().from_string(HOSTILE_TEMPLATES[kind])
    box: dict = {}

    def work():
        try:
            box["text"] = template.render(messages=[{"role": "user", "content": "hi"}])
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=work, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(30)
    assert not t.is_alive(), "the template is still rendering"
    took = time.monotonic() - start
    assert isinstance(box.get("error"), ChatTemplateError), (box.get("error"), len(box.get("text", "")))
    assert "\n" not in str(box["error"]) and took < 30


def test_ordinary_templates_render_as_before():
    from flashmoe.engine.runtime.tokenizer import _make_environment

    env = _make_environment()
    msgs = [{"role": "user", "content": "hi " * 1000}] * 200
    text = env.from_string(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{{ 'x' * 3 }}{{ [1, 2] * 2 }}{{ '%5s' % 'a' }}{{ 'a'|center(5) }}{{ 2 ** 10 }}"
        "{% for x in [1, 2, 3] %}{{ loop.index }}/{{ loop.length }}{% endfor %}"
    ).render(messages=msgs)
    assert text.count("user: ") == 200 and text.endswith("xxx[1, 2, 1, 2]    a  a  10241/32/33/3")


def test_a_turn_ends_at_its_deadline_even_when_the_engine_never_answers():
    """The engine thread busy past --timeout (a template still rendering, a long prefill): the turn
    stops waiting for it soon after its deadline and ends as a timeout."""
    import queue

    from flashmoe.cli.agent import AgentLoop

    class Silent:  # a request the engine never gets to
        def get(self, timeout=None):
            time.sleep(timeout or 0)
            raise queue.Empty

        def cancel(self):
            pass

    class Session:
        def send(self, *a, **k):
            return Silent()

        def __getattr__(self, name):  # save_draft, add, ...: nothing to keep
            return lambda *a, **k: None

    box: dict = {}
    loop = AgentLoop(Session())
    t = threading.Thread(
        target=lambda: box.update(end=loop.run_turn("hi", deadline=time.monotonic() + 0.5)), daemon=True
    )
    start = time.monotonic()
    t.start()
    t.join(20)
    assert not t.is_alive(), "the turn is still waiting for the engine"
    assert box["end"].status == "timeout" and time.monotonic() - start < 10
