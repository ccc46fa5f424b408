"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B): the hybrid of ``qwen3_5.py``, whose
layers it has, read from checkpoints that differ from Qwen3.5's in how they store them.

What differs from Qwen3.5 (transformers' ``modeling_qwen3_next.py`` against ``modeling_qwen3_5*.py``):

- the DeltaNet's four input projections are two tensors, ``in_proj_qkvz`` and ``in_proj_ba``,
  their rows grouped by q/k head (``layers/linear_attention.py``, module doc). The loader reads
  them as Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, runs of rows
  of the fused tensors (``checkpoint_parts``), into the same packed ``in_proj``: a rank reads
  its heads' rows only, and everything after the load is Qwen3.5's;
- a layer's MLP is routed experts plus the gated shared expert, or dense, by Qwen3-MoE's rule
  (``decoder_sparse_step``, ``mlp_only_layers``; every layer dense with ``num_experts`` 0), and
  the top-k renormalisation follows ``norm_topk_prob`` (``ModelConfig.is_sparse_layer``);
- RoPE is plain (no multimodal sections) on the first ``partial_rotary_factor`` of each head,
  which is what Qwen3.5 computes for text; there is no vision-language form;
- the MTP head (``mtp.*``, the same tensors as Qwen3.5's) has ``num_nextn_predict_layers``
  layers, 1 when config.json does not say (``config.py: _read_hybrid``).

Norms, the gated attention, the DeltaNet's conv, gating, delta rule and gated norm, and the
shared expert's gate are the same computations in both.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterator, Mapping

from minivllm.config import QWEN3_NEXT, ModelConfig
from minivllm.layers.linear_attention import fused_in_proj_rows
from minivllm.layers.weights import Loaded, RowRuns
from minivllm.model.qwen3_5 import SKIPPED_PREFIXES, Qwen3_5ForCausalLM
from minivllm.ops.dispatch import Ops


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5's model (module doc); see ``Qwen3_5ForCausalLM`` for the arguments,
    the sharding and what it raises."""

    architecture = QWEN3_NEXT
    skipped_prefixes: Mapping[str, str] = MappingProxyType({"mtp.": SKIPPED_PREFIXES["mtp."]})

    def __init__(self, config: ModelConfig, *, ops: Ops | None = None, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, ops=ops, tp_rank=tp_rank, tp_size=tp_size)
        self.fused_rows = fused_in_proj_rows(config) if config.is_hybrid else {}

    def checkpoint_parts(self, name: str, tensor: Loaded) -> Iterator[tuple[str, Loaded]]:
        """``...linear_attn.in_proj_qkvz.weight`` as ``...in_proj_qkv.weight`` and
        ``...in_proj_z.weight`` (``in_proj_ba`` as ``in_proj_b``, ``in_proj_a``), each its runs of
        the fused tensor's rows; every other tensor as it is."""
        module, _, leaf = name.rpartition(".")
        parent, _, fused = module.rpartition(".")
        layout = self.fused_rows.get(fused)
        if layout is None:
            yield name, tensor
            return
        for part, runs in layout.parts:
            yield f"{parent}.{part}.{leaf}", RowRuns(tensor, runs, layout.rows, name)
