"""`flashmoe serve`: the OpenAI- and Anthropic-compatible HTTP face of the engine."""
