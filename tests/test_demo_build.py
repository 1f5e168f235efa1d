"""When the demo is built again: a demo folder from another shipped fit (an older flashmoe) is
replaced, a current one is kept, and a build that fails leaves the old folder as it was. The
build itself (a minute: GGUF, carve, convert) is stood in for by a folder of marker files; the
real build is exercised by tests/test_demo.py."""

from __future__ import annotations

import pytest

from flashmoe.engine.formats import demo


def fake_build(calls, fail=False):
    def build(gguf, tmp, progress):
        calls.append(tmp)
        if fail:
            raise OSError("disk full")
        out = tmp / "demo"
        (out / "experts").mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "marker").write_text(f"build {len(calls)}")
        return out

    return build


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "_gguf", lambda progress, home=None: tmp_path / "model.gguf")
    monkeypatch.setattr("flashmoe.engine.formats.convert.is_converted", lambda p: (p / "config.json").is_file())
    return tmp_path


def test_built_once_then_kept_while_the_fit_is_the_same(home, monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "_build", fake_build(calls))
    out = demo.ensure_demo(home=home, compile_kernels=False)
    assert out == demo.demo_path(home) and (out / "marker").read_text() == "build 1"
    assert (out / demo.FIT_STAMP).read_text().strip() == demo._fit_digest()
    assert demo.ensure_demo(home=home, compile_kernels=False) == out and len(calls) == 1
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no scratch folder left behind


def test_a_demo_from_another_fit_is_built_again_and_said(home, monkeypatch):
    calls, said = [], []
    monkeypatch.setattr(demo, "_build", fake_build(calls))
    out = demo.ensure_demo(home=home, compile_kernels=False)
    (out / demo.FIT_STAMP).write_text("0" * 64 + "\n")  # as an older flashmoe's fit would read
    demo.ensure_demo(progress=lambda what, *a: said.append(what), home=home, compile_kernels=False)
    assert (out / "marker").read_text() == "build 2"
    assert any("another routing fit" in s for s in said)
    (out / demo.FIT_STAMP).unlink()  # built before the stamp existed
    demo.ensure_demo(home=home, compile_kernels=False)
    assert (out / "marker").read_text() == "build 3" and demo.is_current(out)


def test_rebuild_on_request_and_a_failed_build_keeps_the_old_folder(home, monkeypatch):
    calls = []
    monkeypatch.setattr(demo, "_build", fake_build(calls))
    out = demo.ensure_demo(home=home, compile_kernels=False)
    demo.ensure_demo(home=home, compile_kernels=False, rebuild=True)
    assert (out / "marker").read_text() == "build 2"
    monkeypatch.setattr(demo, "_build", fake_build(calls, fail=True))
    with pytest.raises(OSError, match="disk full"):
        demo.ensure_demo(home=home, compile_kernels=False, rebuild=True)
    assert (out / "marker").read_text() == "build 2" and demo.is_current(out)
    assert [p.name for p in out.parent.iterdir()] == [out.name]
