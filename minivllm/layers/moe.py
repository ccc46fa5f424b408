"""Qwen3-MoE's sparse MLP: a router and experts stacked in two tensors.

Checkpoints store every expert as a dense MLP (``mlp.experts.{e}.gate_proj.weight`` ...);
the loader stacks them at load, through ``FusedExperts.weight_loader``, into::

    gate_up_proj  (E, 2 I_local, H)   rows [0, I_local): expert e's gate, then its up
    down_proj     (E, H, I_local)

Under tensor parallelism every rank holds every expert's slice of the intermediate
dimension (I_local = moe_intermediate_size / tp_size), so the experts' output is this
rank's partial sum, summed over ranks in the next residual add + RMSNorm, as a dense MLP's.
The forward is ``Ops.moe`` (routing, then the experts).

FP8 (``kernels/fp8.py``): with ``fp8_block`` the stacked weights are e4m3 with one float32
scale per 128 x 128 block of each expert's matrices, stacked as the weights are::

    gate_up_proj_scale_inv  (E, 2 I_local / 128, cdiv(H, 128))   from experts.{e}.{gate,up}_proj.weight_scale_inv
    down_proj_scale_inv     (E, cdiv(H, 128), I_local / 128)      from experts.{e}.down_proj.weight_scale_inv

(I_local a multiple of 128: a block never spans gate and up rows or two ranks);
``quantize_fp8_per_channel`` turns loaded 16-bit experts into e4m3 with one scale per output
row, (E, 2 I_local) and (E, H). ``scales`` gives the ops the pair (None: 16-bit experts).
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.config import ModelConfig, cdiv
from minivllm.layers.linear import block_scale_parameter
from minivllm.layers.weights import FP8_BLOCK_SIDE, Loaded, ShardId, divide, load_slice, set_weight_loader
from minivllm.ops.dispatch import FP8_DTYPE, quantize_fp8_per_channel

# Checkpoint projection name -> which part of the stacked tensors it fills.
EXPERT_PROJECTIONS = {"gate_proj": 0, "up_proj": 1, "down_proj": None}
# Checkpoint tensor of an expert's projection -> the suffix of the stacked parameter it fills.
EXPERT_TENSORS = {"weight": "", "weight_scale_inv": "_scale_inv"}


class FusedExperts(nn.Module):
    """Every expert's gate/up and down weights (this rank's slice of each)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp_rank: int = 0, tp_size: int = 1, fp8_block: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        local = divide(intermediate_size, tp_size, "moe_intermediate_size")
        self.local = local
        dtype = FP8_DTYPE if fp8_block else None
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * local, hidden_size, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, local, dtype=dtype), requires_grad=False)
        self.gate_up_proj_scale_inv: nn.Parameter | None = None
        self.down_proj_scale_inv: nn.Parameter | None = None
        self.gate_up_proj_channel_scale: nn.Parameter | None = None  # per-channel FP8 (quantize_fp8_per_channel)
        self.down_proj_channel_scale: nn.Parameter | None = None
        gate_up_ids = tuple((e, part) for e in range(num_experts) for part in (0, 1))
        params = [(self.gate_up_proj, gate_up_ids), (self.down_proj, tuple(range(num_experts)))]
        if fp8_block:
            if local % FP8_BLOCK_SIDE:
                raise ValueError(f"FusedExperts: FP8 block scales need this rank's moe_intermediate_size "
                                 f"({local}) to be a multiple of {FP8_BLOCK_SIDE}")
            blocks, h_blocks = local // FP8_BLOCK_SIDE, cdiv(hidden_size, FP8_BLOCK_SIDE)
            self.gate_up_proj_scale_inv = block_scale_parameter(num_experts, 2 * blocks, h_blocks)
            self.down_proj_scale_inv = block_scale_parameter(num_experts, h_blocks, blocks)
            params += [(self.gate_up_proj_scale_inv, gate_up_ids), (self.down_proj_scale_inv, tuple(range(num_experts)))]
        for param, shard_ids in params:
            set_weight_loader(param, self.weight_loader, shard_ids)

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_proj.dtype == FP8_DTYPE

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """The e4m3 experts' (gate/up, down) scales, block or per-channel; (None, None) for 16 bits."""
        if self.gate_up_proj_scale_inv is not None and self.down_proj_scale_inv is not None:
            return self.gate_up_proj_scale_inv, self.down_proj_scale_inv
        if self.gate_up_proj_channel_scale is not None and self.down_proj_channel_scale is not None:
            return self.gate_up_proj_channel_scale, self.down_proj_channel_scale
        return None, None

    def block_scale_of(self, param: nn.Parameter) -> nn.Parameter | None:
        """The block scales of a stacked e4m3 weight (for filling dummy weights)."""
        if param is self.gate_up_proj:
            return self.gate_up_proj_scale_inv
        return self.down_proj_scale_inv if param is self.down_proj else None

    def quantize_fp8_per_channel(self) -> None:
        """Replace loaded 16-bit experts by e4m3 with one scale per output row of each expert.

        Raises:
            ValueError: the experts are FP8 already.
        """
        if self.is_fp8:
            raise ValueError("FusedExperts: the experts are FP8 already")
        scales = []
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(self, name).data
            parts = [quantize_fp8_per_channel(w[e]) for e in range(w.shape[0])]
            setattr(self, name, nn.Parameter(torch.stack([q for q, _ in parts]), requires_grad=False))
            scales.append(nn.Parameter(torch.stack([s for _, s in parts]), requires_grad=False))
        self.gate_up_proj_channel_scale, self.down_proj_channel_scale = scales

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: ShardId = None) -> None:
        """Expert e's checkpoint matrix into its place: ``(e, 0)`` gate and ``(e, 1)`` up
        (I, H) into ``gate_up_proj[e]``; ``e`` down (H, I) into ``down_proj[e]``; their block
        scales into the scale parameters in units of 128-blocks.

        Raises:
            ValueError: a shard id that names no expert or part, or a wrong checkpoint shape.
        """
        scale = param is self.gate_up_proj_scale_inv or param is self.down_proj_scale_inv
        unit = FP8_BLOCK_SIDE if scale else 1
        local, start, full = self.local // unit, self.tp_rank * self.local // unit, cdiv(self.intermediate_size, unit)
        if param is self.gate_up_proj or param is self.gate_up_proj_scale_inv:
            if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and 0 <= shard_id[0] < self.num_experts
                    and shard_id[1] in (0, 1)):
                raise ValueError(f"FusedExperts.gate_up_proj: no expert part {shard_id!r}")
            e, part = shard_id
            dest = param.data[e, part * local:(part + 1) * local]
            load_slice(dest, loaded, 0, start, full, f"expert {e} {('gate', 'up')[part]}_proj")
        else:
            if not (isinstance(shard_id, int) and not isinstance(shard_id, bool) and 0 <= shard_id < self.num_experts):
                raise ValueError(f"FusedExperts.down_proj: no expert {shard_id!r}")
            load_slice(param.data[shard_id], loaded, 1, start, full, f"expert {shard_id} down_proj")


class SparseMoeBlock(nn.Module):
    """The router (``gate``, replicated: (E, H)) and the experts of one sparse layer."""

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                                    tp_rank, tp_size, fp8_block=config.quantization is not None)


def expert_shard(parts: list[str]) -> tuple[int, str, ShardId] | None:
    """``[..., "experts", "3", "up_proj", "weight"]`` -> (index of "experts", "gate_up_proj",
    (3, 1)): the stacked parameter's name replaces ``experts.3.up_proj.weight``
    (``...weight_scale_inv``: "gate_up_proj_scale_inv"). None: not an expert tensor."""
    for i in range(len(parts) - 3):
        if parts[i] == "experts" and parts[i + 1].isdigit() and parts[i + 2] in EXPERT_PROJECTIONS \
                and parts[i + 3] in EXPERT_TENSORS and i + 4 == len(parts):
            e, part = int(parts[i + 1]), EXPERT_PROJECTIONS[parts[i + 2]]
            stacked = ("down_proj" if part is None else "gate_up_proj") + EXPERT_TENSORS[parts[i + 3]]
            return i, stacked, (e if part is None else (e, part))
    return None
