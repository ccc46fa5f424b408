"""Model definitions (Qwen3) and the checkpoint loader."""
