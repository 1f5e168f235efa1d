"""Real chat templates from tests/fixtures/reference/chat_templates, and tool calls written in the
Qwen3.5 template's XML format."""

from __future__ import annotations

from tests.helpers.paths import ROOT

TEMPLATES = ROOT / "tests" / "fixtures" / "reference" / "chat_templates"

XML_WRITE = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\nx.txt\n</parameter>\n<parameter=content>\n"
    "no\n</parameter>\n</function>\n</tool_call>"
)
XML_READ = "<tool_call>\n<function=read_file>\n<parameter=path>\nnotes.txt\n</parameter>\n</function>\n</tool_call>"


def qwen35_template() -> str:
    return (TEMPLATES / "qwen3.5-family_xml_toolcall.from_gguf.jinja").read_text()


def deepseek_r1_template() -> str:
    """DeepSeek-R1 (0528)'s template is V3's with `<think>\\n` after the generation prompt."""
    v3 = (TEMPLATES / "deepseek_v3_tokenizer_config.chat_template.jinja").read_text()
    gen = "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
    assert gen in v3
    return v3.replace(
        gen, "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
    )
