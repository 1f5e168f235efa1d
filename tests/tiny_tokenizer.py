"""A tiny, deterministic byte-level BPE tokenizer with a ChatML + tools chat template, for tests.

Trained on the fly (a few milliseconds) so tests need no downloaded files and tiny test models
can use a vocabulary of a few hundred ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

# The trainer puts the special tokens at ids 0, 1, 2. The <tool_call> tags come last and are
# plain added tokens (as in Qwen) so they survive decode(skip_special_tokens=True) for
# tool-call parsing.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs
into the forest. Once upon a time there was a small model that wanted to talk about the
weather, the time of day, and what to eat for dinner.

Mixture-of-experts models route each token to a few experts. The router picks the experts
with the highest scores, and the outputs of the chosen experts are added together. Experts
that are not needed stay on the disk until a token asks for them.

We met at a café and talked about naïve ideas, the façade of the old building, and the
piñata at the party. 日本語のテキストも少し入れます。東京は大きな都市です。中文也可以。
Emoji are fun too: 🎉 🙂 🚀 ✨. Numbers like 12, 345 and 6789 appear in text as well.

User: What is the weather in Paris today?
Assistant: It is sunny and warm in Paris, about 24 degrees.
"""

# Written for these tests: ChatML turns, with tools described as JSON lines inside a <tools>
# block of the system turn and calls written as JSON inside <tool_call> tags (Hermes style).
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou can call these functions. Their signatures are listed in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{% endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply with a JSON object inside <tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function or call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{% endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}
"""


def build_tiny_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """Train the tokenizer in memory; the whole vocabulary (added tokens included) <= vocab_size."""
    added = len(SPECIAL_TOKENS) + len(TOOL_TOKENS)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + added:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + added}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - added, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    return tok


def write_tiny_tokenizer(folder: Path, vocab_size: int = 320) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
