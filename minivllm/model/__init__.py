"""Model definitions (Qwen3, Qwen2/2.5, Llama-3.x over one shared decoder), the registry
that picks one by architecture, and the checkpoint loader."""
