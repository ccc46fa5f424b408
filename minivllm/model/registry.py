"""Which model class loads a checkpoint: ``architectures[0]`` of its config.json.

``minivllm.config.SUPPORTED_ARCHITECTURES`` lists the same names (the config
refuses others before any torch code runs); this module maps them to classes.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

from minivllm.config import ModelConfig
from minivllm.model.decoder import DecoderForCausalLM
from minivllm.model.llama import LlamaForCausalLM
from minivllm.model.qwen2 import Qwen2ForCausalLM
from minivllm.model.qwen3 import Qwen3ForCausalLM
from minivllm.model.qwen3_5 import (Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5MoeForCausalLM,
                                    Qwen3_5MoeForConditionalGeneration)
from minivllm.model.qwen3_moe import Qwen3MoeForCausalLM
from minivllm.model.qwen3_next import Qwen3NextForCausalLM
from minivllm.ops.dispatch import Ops

MODEL_CLASSES: Mapping[str, type[DecoderForCausalLM]] = MappingProxyType({
    cls.architecture: cls for cls in (Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM,
                                      Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration,
                                      Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM)
})


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The class that loads ``architecture`` checkpoints.

    Raises:
        ValueError: an architecture we have no class for (the message lists those we have).
    """
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {tuple(MODEL_CLASSES)}")
    return MODEL_CLASSES[architecture]


def build_model(config: ModelConfig, *, ops: Ops | None = None,
                tp_rank: int = 0, tp_size: int = 1) -> DecoderForCausalLM:
    """An unloaded model of ``config.architecture``'s class (weights come from ``load_weights``),
    running its ops as ``ops`` says (default: the torch references).

    Raises:
        ValueError: an unsupported architecture, or shapes that do not split over ``tp_size``.
    """
    return model_class(config.architecture)(config, ops=ops, tp_rank=tp_rank, tp_size=tp_size)
