"""Model formats and conversion: safetensors I/O, `flashmoe convert` (mlx-lm / Hugging Face
folders and GGUF files into packed experts), the Hugging Face cache, and the demo model's build."""
