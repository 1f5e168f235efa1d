"""The runtime: loading a model with streamed experts (loader), the engine thread and its events,
generation, sampling, the tokenizer and chat templates, per-layer timing."""
