"""``Ops``: the one dispatch point between the model and the kernels.

The executor builds one ``Ops`` from its config and device and hands it to the model at
construction (``build_model``), as it hands the attention metadata to every forward. It
says, for every fused op the model calls:

- ``triton``: our Triton kernels (``minivllm/kernels/``) or their torch references;
- ``use_gemv``: whether linear layers of at most ``MAX_ROWS`` rows take the GEMV kernel (Triton,
  16-bit weights), which the decoder's small-batch forward uses;
- ``pdl``: whether launches take part in programmatic dependent launch (docs/tuning.md, "PDL");
- ``comm``: the tensor-parallel communicator, None with one rank.

The weights say the rest: an FP8 weight (e4m3, passed with its ``scale``) takes the FP8
GEMM or, at one row, the FP8 GEMV (``kernels/fp8_gemm.py``, ``fp8_gemv.py``).

Nothing here or in the kernels is process-wide: two engines in one process hold two
``Ops`` and never see each other's choices.

One rule the decoder relies on: a row-parallel layer (``o_proj``, ``down_proj``) always
feeds a residual add + RMSNorm, so its output is this rank's *partial* sum and
``add_rms_norm`` is where the ranks' partial sums meet (one fused kernel on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from minivllm.config import KERNEL_CHOICES
from minivllm.envs import triton_interpreted
from minivllm.kernels import linear_attention_reference as linref
from minivllm.kernels import reference as ref
from minivllm.kernels.fp8 import FP8_DTYPE, quantize_fp8_block, quantize_fp8_per_channel
from minivllm.kernels.gemv import MAX_ROWS
from minivllm.kernels.gumbel_sample import gumbel_best_reference, gumbel_sample_reference, hashed_uniform, row_keys
from minivllm.ops.communicator import Communicator
from minivllm.ops.metadata import AttentionMetadata, StateMetadata

# Besides Ops, what the rooms above take from the kernels' side, all plain torch: the weight
# formats the layers and the loader build at load time (e4m3 and its two quantizers, per
# 128 x 128 block and per output channel) and the sampler's noise (its torch reference's).
__all__ = ["FP8_DTYPE", "MAX_ROWS", "Ops", "fp8_mode", "hashed_uniform", "row_keys", "quantize_fp8_block",
           "quantize_fp8_per_channel", "triton_runs_on"]

# MAX_ROWS, the most rows the GEMV kernel takes (tl.dot's smallest tile), is the small-batch
# forward's limit.
GEMV_DTYPES = (torch.bfloat16, torch.float16)
# An e4m3 MoE layer's (gate/up, down) scales, block or per channel; (None, None): 16-bit experts.
ExpertScales = tuple[torch.Tensor, torch.Tensor] | tuple[None, None]
# Sparse layers of at most this many tokens take the per-pair expert GEMVs: why, docs/tuning.md,
# "Experts at few tokens".
MOE_GEMV_MAX_TOKENS = 4


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: CUDA, or the CPU under Triton's
    interpreter (``TRITON_INTERPRET=1``, how the CPU tests run them)."""
    return device.type == "cuda" or triton_interpreted()


@dataclass(frozen=True, eq=False)
class Ops:
    """What every fused op runs (see the module doc). Build it with :meth:`build`."""

    triton: bool
    use_gemv: bool
    pdl: bool
    comm: Communicator | None = None

    @classmethod
    def build(cls, kernels: str, device: torch.device, dtype: torch.dtype,
              comm: Communicator | None = None) -> "Ops":
        """The ops of an engine on ``device`` in ``dtype``: ``kernels`` "auto" is Triton on CUDA
        and the torch references elsewhere; PDL is on with one rank where the GPU has it
        (under tensor parallelism it is off: docs/tuning.md, "PDL").

        Raises:
            ValueError: an unknown ``kernels``, or "triton" where Triton cannot run.
        """
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
        if kernels == "triton" and not triton_runs_on(device):
            raise ValueError(f"kernels='triton' needs a CUDA device (or TRITON_INTERPRET=1 on the CPU), got {device}")
        triton = kernels == "triton" or (kernels == "auto" and device.type == "cuda")
        pdl = False
        # Not under Triton's interpreter, which runs no PDL launch (CUDA tensors or not).
        if triton and comm is None and device.type == "cuda" and not triton_interpreted():
            from minivllm.kernels._launch import pdl_supported
            pdl = pdl_supported(device)
        return cls(triton=triton, use_gemv=triton and dtype in GEMV_DTYPES, pdl=pdl, comm=comm)

    def few_rows(self, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` rows takes the decoder's small-batch path."""
        return self.use_gemv and num_tokens <= MAX_ROWS

    def begin_forward(self) -> None:
        """Called as every model forward starts (the communicator checks its state)."""
        if self.comm is not None:
            self.comm.begin_forward()

    # ---- norms and activations ---------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of each row of ``x`` (..., N)."""
        if self.triton:
            from minivllm.kernels.rms_norm import rms_norm
            return rms_norm(x, weight, eps, pdl=self.pdl)  # type: ignore[return-value]
        return ref.rms_norm_ref(x, weight, eps)

    def add_rms_norm(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(s), s)`` with ``s = sum over ranks of partial + residual``: with one rank
        the residual add + RMSNorm; under tensor parallelism the all-reduce too (one kernel where
        the communicator's fused path takes the shape)."""
        if self.comm is not None:
            fused = self.comm.add_rms_norm(partial, residual, weight, eps, self.pdl)
            if fused is not None:
                return fused
            partial = self.comm.all_reduce(partial)
        if self.triton:
            from minivllm.kernels.rms_norm import rms_norm
            return rms_norm(partial, weight, eps, residual=residual, pdl=self.pdl)  # type: ignore[return-value]
        return ref.add_rms_norm_ref(partial, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``x = [gate | up]`` (..., 2I) -> (..., I)."""
        if self.triton:
            from minivllm.kernels.silu_and_mul import silu_and_mul
            return silu_and_mul(x, pdl=self.pdl)
        return ref.silu_and_mul_ref(x)

    # ---- linear layers -------------------------------------------------------

    def gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             gated: bool = False, out: torch.Tensor | None = None,
             scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)`` for at most ``MAX_ROWS`` rows: the GEMV kernel where it takes the
        shape, else cuBLAS (``gated``: the input is ``silu_and_mul(x)``); into ``out`` if given.
        An FP8 weight (``scale`` its scale): at one row the FP8 GEMV (x stays 16-bit), else
        :meth:`linear`'s FP8 GEMM."""
        from minivllm.kernels.gemv import gemv, gemv_takes

        if weight.dtype == FP8_DTYPE:
            return self._to_out(self._fp8_linear(x, weight, scale, one_row=True, gated=gated), bias, out)
        if gemv_takes(x, weight, gated=gated):
            return gemv(x, weight, bias, out=out, gated=gated, pdl=self.pdl)
        return self.linear(self.silu_and_mul(x) if gated else x, weight, bias, out=out)

    def norm_gemv(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                  eps: float, weight: torch.Tensor, bias: torch.Tensor | None, *,
                  scale: torch.Tensor | None = None, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gemv(rms_norm(s)), s)`` with ``s`` as :meth:`add_rms_norm` sums it (residual None:
        ``s = x``, already whole). One kernel at one row where nothing is left to sum over ranks
        (the GEMV, 16-bit or FP8, normalises its input row as it streams W); else the norm,
        then :meth:`gemv`. ``unit_offset``: the zero-centred norm (:meth:`rms_norm_1p`; the
        16-bit GEMV fuses it, the FP8 one does not)."""
        whole = residual is None or self.comm is None  # nothing left to sum over ranks
        if (weight.dtype == FP8_DTYPE and x.shape[0] == 1 and whole and self.triton and bias is None
                and not unit_offset):
            from minivllm.kernels.fp8_gemv import rms_norm_fp8_gemv
            return rms_norm_fp8_gemv(x, residual, norm_weight, eps, weight, scale, fp8_mode(scale, weight),
                                     pdl=self.pdl)
        if x.shape[0] == 1 and whole and weight.dtype != FP8_DTYPE:
            from minivllm.kernels.gemv import gemv_takes, rms_norm_gemv

            if gemv_takes(x, weight, norm_weight=norm_weight, residual=residual):
                return rms_norm_gemv(x, residual, norm_weight, eps, weight, bias, pdl=self.pdl,
                                     unit_offset=unit_offset)
        h, residual = self._norm(x, residual, norm_weight, eps, unit_offset)
        return self.gemv(h, weight, bias, scale=scale), residual

    def norm_project(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                     eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     scale: torch.Tensor | None = None, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(project(rms_norm(s)), s)`` at any batch, ``s`` as :meth:`norm_gemv` sums it: at
        few rows :meth:`norm_gemv` (one kernel at one row), else the norm, then :meth:`linear`.
        For layers that have no small-batch forward of their own (the hybrid models')."""
        if self.few_rows(x.shape[0]):
            return self.norm_gemv(x, residual, norm_weight, eps, weight, bias, scale=scale, unit_offset=unit_offset)
        h, residual = self._norm(x, residual, norm_weight, eps, unit_offset)
        return self.linear(h, weight, bias, scale=scale), residual

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
              unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(s), s)``: s = x (residual None), else as :meth:`add_rms_norm` sums it."""
        if residual is None:
            return (self.rms_norm_1p if unit_offset else self.rms_norm)(x, norm_weight, eps), x
        return (self.add_rms_norm_1p if unit_offset else self.add_rms_norm)(x, residual, norm_weight, eps)

    def project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                gated: bool = False, out: torch.Tensor | None = None,
                scale: torch.Tensor | None = None) -> torch.Tensor:
        """A linear layer at any batch (``gated``: of ``silu_and_mul(x)``): :meth:`gemv` where the
        rows are few (:meth:`few_rows`), else :meth:`linear`. For layers that have no
        small-batch forward of their own (the hybrid models')."""
        if self.few_rows(x.shape[0]):
            return self.gemv(x, weight, bias, gated=gated, out=out, scale=scale)
        return self.linear(self.silu_and_mul(x) if gated else x, weight, bias, out=out, scale=scale)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None, *, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x W^T (+ bias)`` by cuBLAS (or the CPU's GEMM), into ``out`` (2-D x) if given. An
        FP8 weight (``scale`` its block or per-channel scale, ``kernels/fp8.py``): the FP8 GEMM,
        x quantized per token (and 128-column group) on the fly, or its torch reference."""
        if weight.dtype == FP8_DTYPE:
            return self._to_out(self._fp8_linear(x, weight, scale, one_row=False), bias, out)
        if out is None:
            return F.linear(x, weight, bias)
        torch.matmul(x, weight.t(), out=out)
        if bias is not None:
            out += bias
        return out

    def _fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, *,
                    one_row: bool, gated: bool = False) -> torch.Tensor:
        """``x W^T`` (T, N) for an FP8 weight (``gated``: of ``silu_and_mul(x)``): with
        ``one_row`` and one row the FP8 GEMV (the weights' bytes, x in 16 bits, SiLU-and-mul
        inside it), else the W8A8 GEMM; the torch references off Triton.

        Raises:
            ValueError: no scale.
        """
        mode = fp8_mode(scale, weight)
        if one_row and x.shape[0] == 1 and self.triton:
            from minivllm.kernels.fp8_gemv import fp8_gemv
            return fp8_gemv(x, weight, scale, mode, gated=gated, pdl=self.pdl)
        x = self.silu_and_mul(x) if gated else x
        if one_row and x.shape[0] == 1:
            return ref.fp8_gemv_reference(x, weight, scale, mode)
        if self.triton:
            from minivllm.kernels.fp8_gemm import fp8_gemm
            return fp8_gemm(x, weight, scale, mode)
        return ref.fp8_gemm_reference(x, weight, scale, mode)

    @staticmethod
    def _to_out(y: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        """``y (+ bias)``, written into ``out`` if given."""
        if bias is not None:
            y = y + bias
        if out is None:
            return y
        out.copy_(y)
        return out

    def partial_out(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """Where a row-parallel layer of ``weight`` (N, K) writes its partial sum of ``x`` (T, K):
        the communicator's (T, N) buffer that the next ``add_rms_norm`` reads without a copy,
        or None (a new tensor)."""
        return self.comm.partial_slot((x.shape[0], weight.shape[0]), x.dtype) if self.comm is not None else None

    def moe(self, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            top_k: int, norm_topk_prob: bool, *, scales: ExpertScales = (None, None)) -> torch.Tensor:
        """A sparse MLP: (T, H) -> this rank's (T, H) partial sum of the top-k experts of every
        token (``layers/moe.py``). Triton: routing on the device, then for at most
        ``MOE_GEMV_MAX_TOKENS`` tokens one GEMV per (token, expert) pair, else the
        expert-contiguous layout and the grouped GEMMs; no host sync (CUDA graphs capture
        it). The torch reference routes on the host and is not captured. e4m3 experts
        (``scales`` their gate/up and down scales, block or per channel): the same two paths
        in FP8 (the GEMVs weight-only, the grouped GEMM W8A8), or their references."""
        w13_scale, w2_scale = scales
        fp8 = gate_up.dtype == FP8_DTYPE
        few = x.shape[0] <= MOE_GEMV_MAX_TOKENS
        if not self.triton:
            if not fp8:
                return ref.moe_reference(x, router, gate_up, down, top_k, norm_topk_prob)
            weights, ids = ref.moe_topk_reference(F.linear(x, router).float(), top_k, norm_topk_prob)
            experts = ref.moe_gemv_fp8_reference if few else ref.fused_moe_fp8_reference
            return experts(x, gate_up, down, weights, ids, w13_scale, w2_scale, fp8_mode(w13_scale, gate_up))
        from minivllm.kernels.fused_moe import default_tiles, fused_moe
        from minivllm.kernels.moe_align import moe_align
        from minivllm.kernels.moe_gemv import moe_gemv
        from minivllm.kernels.moe_topk import moe_topk

        # (T, E) in x's dtype, as transformers (the softmax widens them); at decode sizes through
        # the GEMV where it takes the shape (docs/tuning.md, "Experts at few tokens").
        logits = self.gemv(x, router) if self.few_rows(x.shape[0]) else F.linear(x, router)
        weights, ids = moe_topk(logits, top_k, norm_topk_prob, pdl=self.pdl)
        if few:
            return moe_gemv(x, gate_up, down, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, pdl=self.pdl)
        block_m, tiles = default_tiles(x.shape[0], top_k, gate_up.shape[0], gate_up.dtype)
        layout = moe_align(ids, gate_up.shape[0], block_m, pdl=self.pdl)
        return fused_moe(x, gate_up, down, weights, layout, tiles, w13_scale=w13_scale, w2_scale=w2_scale,
                         pdl=self.pdl)

    # ---- attention ---------------------------------------------------------------

    def qk_norm_rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, eps: float, cos_sin_cache: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
        """Per-head q/k RMSNorm (none where the weights are None) and RoPE of the packed ``qkv``
        (T, (H + 2 Hkv) D); k and v stored at ``slot_mapping`` (an FP8 cache: divided by the
        layer's scales and rounded to e4m3); returns q (T, H, D)."""
        fn = ref.qk_norm_rope_store_reference
        if self.triton:
            from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store as fn
        return fn(qkv, positions, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping,
                  k_scale, v_scale)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, k_scale: torch.Tensor,
                  v_scale: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` (T, H, D) over each sequence's paged K/V (which hold the fed tokens
        already; an FP8 cache is read through the layer's scales): the decode kernel when every
        sequence feeds one token, else the prefill one."""
        if not self.triton:  # one reference for both shapes (it syncs the host)
            return ref.paged_attention_reference(q, k_cache, v_cache, meta.cu_seqlens_q, meta.kv_lens,
                                                 meta.block_tables, scale, k_scale, v_scale)
        if meta.is_decode:
            from minivllm.kernels.decode_attention import decode_attention
            return decode_attention(q, k_cache, v_cache, meta.kv_lens, meta.block_tables, scale, pdl=self.pdl,
                                    k_scale=k_scale, v_scale=v_scale)
        from minivllm.kernels.prefill_attention import prefill_attention
        return prefill_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.kv_lens, meta.block_tables,
                                 scale, meta.max_q_len, tile_map=meta.tile_map, k_scale=k_scale, v_scale=v_scale)

    @staticmethod
    def prefill_tile_rows(dtype: torch.dtype, head_dim: int, max_q_len: int, num_heads: int,
                          num_kv_heads: int) -> int:
        """Tokens per q tile of the prefill kernel's default config for chunks of up to
        ``max_q_len`` tokens: what a prefill graph bakes in for its bucket."""
        from minivllm.kernels.prefill_attention import default_config, tile_rows
        return tile_rows(default_config(dtype, head_dim, max_q_len), num_heads, num_kv_heads)

    @staticmethod
    def prefill_tile_map(q_lens: np.ndarray, block_q: int, capacity: int) -> np.ndarray:
        """The prefill kernel's (capacity, 2) int32 work list of (sequence, q tile) rows for
        sequences of ``q_lens`` tokens (``kernels/prefill_attention.py``: ``build_tile_map``)."""
        from minivllm.kernels.prefill_attention import build_tile_map
        return build_tile_map(q_lens, block_q, capacity)

    # ---- hybrid models (Qwen3.5): gated attention and the Gated DeltaNet -----------------------
    # Triton kernels where ``triton`` is set, tested against the torch references
    # (``kernels/reference.py``, ``kernels/linear_attention_reference.py``); an op that has
    # none runs its reference on both paths.

    def rms_norm_1p(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Zero-centred RMSNorm ``(1 + weight) * x / rms(x)`` of each row of ``x`` (..., N)."""
        if self.triton:
            from minivllm.kernels.rms_norm import rms_norm_1p
            return rms_norm_1p(x, weight, eps, pdl=self.pdl)  # type: ignore[return-value]
        return ref.rms_norm_1p_ref(x, weight, eps)

    def add_rms_norm_1p(self, partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`add_rms_norm` with the zero-centred norm: ``(rms_norm_1p(s), s)``, ``s`` the
        ranks' partial sums plus the residual."""
        if self.comm is not None:
            partial = self.comm.all_reduce(partial)
        if self.triton:
            from minivllm.kernels.rms_norm import rms_norm_1p
            return rms_norm_1p(partial, weight, eps, residual=residual, pdl=self.pdl)  # type: ignore[return-value]
        return ref.add_rms_norm_1p_ref(partial, residual, weight, eps)

    def rms_norm_gated(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * rms_norm(x) * silu(gate)`` over the last dim (the DeltaNet's output norm)."""
        if self.triton:
            from minivllm.kernels.rms_norm_gated import rms_norm_gated
            return rms_norm_gated(x, gate, weight, eps)
        return ref.rms_norm_gated_ref(x, gate, weight, eps)

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """``x * sigmoid(gate)``, gate broadcast over x (an output gate). No kernel: two eager
        elementwise ops, which a CUDA graph captures as they are."""
        return ref.sigmoid_mul_ref(x, gate)

    def qk_norm_1p_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                              q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                              cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: torch.Tensor,
                              v_scale: torch.Tensor) -> torch.Tensor:
        """Zero-centred q/k norm per head, RoPE of the first ``cos_sin_cache.shape[1]`` dims,
        k and v stored at ``slot_mapping``; returns q (T, H, D). Triton: one kernel, no host sync
        (the reference's filtering of -1 slots syncs)."""
        fn = ref.qk_norm_1p_rope_store_reference
        if self.triton:
            from minivllm.kernels.qk_norm_1p_rope_store import qk_norm_1p_rope_store as fn
        return fn(q, k, v, positions, q_weight, k_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping,
                  k_scale, v_scale)

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      cu_seqlens: torch.Tensor, state: StateMetadata) -> torch.Tensor:
        """SiLU of the causal depthwise conv of ``x`` (T, C) per sequence, continuing from and
        updating each sequence's slot of ``conv_state`` (num_entries, C, K - 1), and writing
        the state at ``state``'s save points (Triton: ``kernels/causal_conv1d.py``)."""
        if self.triton:
            from minivllm.kernels.causal_conv1d import causal_conv1d
            return causal_conv1d(x, weight, conv_state, cu_seqlens, state.slots, state.has_initial_state,
                                 state.save_rows, state.save_offsets, state.save_slots,
                                 save_bounds=state.save_bounds)
        return linref.causal_conv1d_reference(x, weight, conv_state, cu_seqlens, state.slots,
                                              state.has_initial_state, _save_points(state))

    def gdn_gating(self, a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                   dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, beta)`` (T, H): the delta rule's float32 log decay and its write strength
        (Triton: ``kernels/gdn_gating.py``, one launch for the reference's seven)."""
        if self.triton:
            from minivllm.kernels.gdn_gating import gdn_gating
            return gdn_gating(a, b, a_log, dt_bias)
        return linref.gdn_gating_reference(a, b, a_log, dt_bias)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, recurrent_state: torch.Tensor, cu_seqlens: torch.Tensor,
                         state: StateMetadata, decode: bool) -> torch.Tensor:
        """The gated delta rule over every sequence's rows from its slot of ``recurrent_state``
        (num_entries, H, K, V), which it updates, and writes the state at ``state``'s save points:
        (T, H, V). ``decode`` (every sequence feeds one token): the one-step recurrence, token by
        token (``kernels/gated_delta_rule_recurrent.py``); else the chunked form, a triangular
        system per chunk on tensor cores (``kernels/gated_delta_rule_chunked.py``; TF32 products
        for 16-bit models, float32-accurate ones for float32). Neither Triton kernel syncs the
        host, so CUDA graphs may hold them."""
        if self.triton:
            if decode:
                from minivllm.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent as kernel
            else:
                from minivllm.kernels.gated_delta_rule_chunked import gated_delta_rule_chunked as kernel
            return kernel(q, k, v, g, beta, recurrent_state, cu_seqlens, state.slots, state.has_initial_state,
                          state.save_rows, state.save_offsets, state.save_slots, save_bounds=state.save_bounds)
        rule = linref.gated_delta_rule_recurrent_reference if decode else linref.gated_delta_rule_chunked_reference
        return rule(q, k, v, g, beta, recurrent_state, cu_seqlens, state.slots, state.has_initial_state,
                    _save_points(state))

    # ---- sampling ------------------------------------------------------------------

    def gumbel_sample(self, logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None,
                      greedy: torch.Tensor, seeded: torch.Tensor, seed_keys: torch.Tensor, step_seed: int,
                      counts: torch.Tensor | None) -> torch.Tensor:
        """One token id per row of ``logits`` (S, V) -> (S,) int64: greedy rows argmax, the others
        a Gumbel-max draw keyed by their seeds (``kernels/gumbel_sample.py``; ``counts``: the fused
        pass's zeroed split counters, Triton only)."""
        if self.triton:
            from minivllm.kernels.gumbel_sample import gumbel_sample
            return gumbel_sample(logits, temperature, floor, greedy, seeded, seed_keys, step_seed, counts=counts)
        return gumbel_sample_reference(logits, temperature, floor, greedy, seeded, seed_keys, step_seed)

    def gumbel_pairs(self, shard: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                     seeded: torch.Tensor, seed_keys: torch.Tensor, step_seed: int, col_offset: int,
                     all_greedy: bool, counts: torch.Tensor | None) -> torch.Tensor:
        """A vocab shard's best (value, global column) per row as one (S, 2) float32 tensor (the
        message the vocab-parallel sampler gathers): :meth:`gumbel_sample`'s draw over the
        columns ``col_offset ..`` of ``shard`` (S, V_rank), no filter.

        Raises:
            ValueError: a global column that float32 cannot hold exactly.
        """
        if self.triton:  # one launch writes the pairs (greedy rows included)
            from minivllm.kernels.gumbel_sample import gumbel_pairs
            return gumbel_pairs(shard, temperature, None, greedy, seeded, seed_keys, step_seed,
                                col_offset=col_offset, counts=counts)
        if shard.shape[1] + col_offset > 1 << 24:
            raise ValueError(f"vocab columns up to {shard.shape[1] + col_offset} are not exact in float32")
        if all_greedy:
            value, col = shard.max(dim=-1)  # the first maximum, as argmax
        else:
            value, col = gumbel_best_reference(shard, temperature, None, greedy, seeded, seed_keys, step_seed,
                                               col_offset=col_offset)
        return torch.stack([value.float(), (col + col_offset).float()], dim=1)

    # ---- vocabulary ----------------------------------------------------------------

    def embed(self, ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, vocab_end: int) -> torch.Tensor:
        """Embedding rows of ``ids`` (T,) -> (T, dim); under tensor parallelism each rank looks up
        its vocabulary range ``[vocab_start, vocab_end)`` and the ranks' rows are summed."""
        if self.comm is None:
            return F.embedding(ids, weight)
        lookup = ref.vocab_shard_embedding_reference
        if self.triton:
            from minivllm.kernels.vocab_embedding import vocab_shard_embedding as lookup
        return self.comm.all_reduce(lookup(ids, weight, vocab_start, vocab_end))


def _save_points(state: StateMetadata) -> linref.SavePoints:
    """The step's save points by sequence, as the references take them."""
    return linref.save_points(state.save_rows, state.save_offsets, state.save_slots)


def fp8_mode(scale: torch.Tensor | None, weight: torch.Tensor) -> str:
    """An e4m3 weight's scale mode by its scale's rank: "block" (one scale per 128 x 128 block,
    as many dimensions as the weight: (N, K) or stacked experts' (E, N, K)) or "channel" (one
    per output row, a dimension fewer).

    Raises:
        ValueError: no scale.
    """
    if scale is None:
        raise ValueError(f"an FP8 weight {tuple(weight.shape)} needs its scale")
    return "block" if scale.dim() == weight.dim() else "channel"
