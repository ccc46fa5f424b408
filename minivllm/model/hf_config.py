"""The model's ``ModelConfig`` from a checkpoint: its ``config.json``, or the same keys
derived from a GGUF file's metadata (``gguf.hf_config``). The front ends (``LLM``, the
server) ask here; ``minivllm.config`` itself reads no checkpoint format beyond JSON."""

from __future__ import annotations

import os

from minivllm.config import ModelConfig
from minivllm.model.gguf import hf_config, is_gguf_file


def read_model_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint at ``path``: a directory holding ``config.json``,
    that file, or a ``.gguf`` file.

    Raises:
        ValueError: unsupported architecture or feature, or a missing/invalid field.
    """
    if is_gguf_file(path):
        return ModelConfig.from_hf_dict(hf_config(path), path)
    return ModelConfig.from_hf_json(path)
