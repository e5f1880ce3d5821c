"""qwen-serving: Qwen3.8-27B on one 24 GB GPU over a pinned, patched vLLM."""

__version__ = "0.1.0"

# The stack every patch, launcher and test is written against.
VLLM_PIN = "0.28.0"
TORCH_PIN = "2.13.0"
