"""Qwen3-MoE's sparse MLP: a router and experts stacked in two tensors.

Checkpoints store every expert as a dense MLP (``mlp.experts.{e}.gate_proj.weight`` ...);
the loader stacks them at load, through ``FusedExperts.weight_loader``, into::

    gate_up_proj  (E, 2 I_local, H)   rows [0, I_local): expert e's gate, then its up
    down_proj     (E, H, I_local)

Under tensor parallelism every rank holds every expert's slice of the intermediate
dimension (I_local = moe_intermediate_size / tp_size), so the experts' output is this
rank's partial sum, summed over ranks in the next residual add + RMSNorm, as a dense MLP's.
The forward is ``Ops.moe`` (routing, then the experts).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.layers.linear import Loaded, ShardId, divide, load_slice, set_weight_loader

# Checkpoint projection name -> which part of the stacked tensors it fills.
EXPERT_PROJECTIONS = {"gate_proj": 0, "up_proj": 1, "down_proj": None}


class FusedExperts(nn.Module):
    """Every expert's gate/up and down weights (this rank's slice of each)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        local = divide(intermediate_size, tp_size, "moe_intermediate_size")
        self.local = local
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local), requires_grad=False)
        set_weight_loader(self.gate_up_proj, self.weight_loader,
                          tuple((e, part) for e in range(num_experts) for part in (0, 1)))
        set_weight_loader(self.down_proj, self.weight_loader, tuple(range(num_experts)))

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Expert e's checkpoint matrix into its place: ``(e, 0)`` gate and ``(e, 1)`` up
        (I, H) into ``gate_up_proj[e]``; ``e`` down (H, I) into ``down_proj[e]``.

        Raises:
            ValueError: a shard id that names no expert or part, or a wrong checkpoint shape.
        """
        start = self.tp_rank * self.local
        if param is self.gate_up_proj:
            if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < self.num_experts
                    and shard_id[1] in (0, 1)):
                raise ValueError(f"FusedExperts.gate_up_proj: no expert part {shard_id!r}")
            e, part = shard_id
            dest = param.data[e, part * self.local:(part + 1) * self.local]
            load_slice(dest, loaded, 0, start, self.intermediate_size, f"expert {e} {('gate', 'up')[part]}_proj")
        else:
            if not (isinstance(shard_id, int) and not isinstance(shard_id, bool) and 0 <= shard_id < self.num_experts):
                raise ValueError(f"FusedExperts.down_proj: no expert {shard_id!r}")
            load_slice(param.data[shard_id], loaded, 1, start, self.intermediate_size,
                       f"expert {shard_id} down_proj")


class SparseMoeBlock(nn.Module):
    """The router (``gate``, replicated: (E, H)) and the experts of one sparse layer."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                    tp_rank, tp_size)


def expert_shard(parts: list[str]) -> tuple[int, ShardId] | None:
    """``[..., "experts", "3", "up_proj", "weight"]`` -> (index of "experts", (3, 1)); the
    stacked parameter's name replaces ``experts.3.up_proj.weight``. None: not an expert tensor."""
    for i in range(len(parts) - 3):
        if parts[i] == "experts" and parts[i + 1].isdigit() and parts[i + 2] in EXPERT_PROJECTIONS \
                and parts[i + 3] == "weight" and i + 4 == len(parts):
            e, part = int(parts[i + 1]), EXPERT_PROJECTIONS[parts[i + 2]]
            return i, (e if part is None else (e, part))
    return None


def moe_reference(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """(T, H) -> (T, H): this rank's partial sum of the routed experts, as transformers'
    ``Qwen3MoeSparseMoeBlock`` computes it: router logits in x's dtype, softmax and top-k in
    float32 (renormalised when ``norm_topk_prob``), the weights back in x's dtype, each
    expert a SiLU-gated MLP over its tokens, weighted and summed per token."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the torch reference experts route on the host and cannot be captured in a "
                           "CUDA graph: use the Triton kernels or enforce_eager=True")
    logits = torch.nn.functional.linear(x, router)                              # (T, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)                             # (T, k)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    local = down.shape[2]
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        gu = torch.nn.functional.linear(x[token], gate_up[e])                   # (n, 2 I_local)
        act = torch.nn.functional.silu(gu[:, :local]) * gu[:, local:]
        y = torch.nn.functional.linear(act, down[e]) * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
