"""The marker pairs reasoning ("thinking") blocks are written in: chat-template vocabulary that the
engine (does the prompt leave one open?) and the text state machine (tools/textstate.py: which
text is reasoning?) both need. Plain data, importing nothing.
"""

# (open, close). <think> is Qwen3 / Qwen3.5 / Qwen3-Next / QwQ / DeepSeek-R1 / V3.1 / GLM;
# [THINK] is Mistral's Magistral; the rest are the pairs mlx-lm 0.32's tokenizer_utils knows
# (_infer_thinking): LongCat, <|think:start|>, Gemma's thought channel, and the xtml vocabulary.
REASONING_MARKERS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("[THINK]", "[/THINK]"),
    ("<longcat_think>", "</longcat_think>"),
    ("<|think:start|>", "<|think:end|>"),
    ("<|channel>thought", "<channel|>"),
    ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
)
