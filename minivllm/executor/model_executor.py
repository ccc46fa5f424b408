"""``ModelExecutor``: the real Qwen3 behind the ``Executor`` protocol.

One step::

    StepPlan --prepare_inputs (numpy)--> BatchInputs --upload--> DeviceBatch
             --model--> hidden (T, hidden) --rows sample_indices--> logits (S, V)
             --sampler--> token ids (S,) --one host sync--> StepResult

The KV cache is ONE tensor for all layers::

    kv_cache  (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
              kv_cache[l, 0] = layer l's K cache, kv_cache[l, 1] = its V cache

so each layer's K (or V) cache is a contiguous (num_blocks, block_size, Hkv, D)
view, token slot s living at [s // block_size, s % block_size].

The CUDA path will add two things (structured for, not built yet): sizing the
block pool from free memory (``size_kv_pool_from_free_memory``) and CUDA
graphs for decode-only batches (``_forward`` is the single place that would
route them to a graph runner).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from minivllm.config import ModelConfig
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.executor.inputs import BatchInputs, prepare_inputs
from minivllm.layers.attention import BACKENDS, AttentionMetadata, make_attention_backend
from minivllm.layers.sampler import Sampler, SamplingTensors
from minivllm.model.loader import load_weights
from minivllm.model.qwen3 import Qwen3ForCausalLM

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in ``dtype`` (no float32 copy first); restored on exit."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


@dataclass(frozen=True)
class DeviceBatch:
    """One step's model inputs on the device (shapes as in ``BatchInputs``)."""

    input_ids: torch.Tensor       # int64 (T,)
    positions: torch.Tensor       # int64 (T,)
    sample_indices: torch.Tensor  # int64 (S,)
    attn_metadata: AttentionMetadata


class ModelExecutor:
    """Runs ``StepPlan``s on Qwen3 over a paged KV cache it owns.

    Args:
        model_config: the model's shapes.
        model_path: directory of the safetensors checkpoint.
        device: torch device ("cpu", "cuda", "cuda:1", ...).
        dtype: parameter and KV cache dtype (torch dtype or "float32"/"bfloat16"/"float16").
        attention_backend: "torch" (reference) or "triton" (own kernels).
        block_size: tokens per KV block (must equal the plans' block size).
        num_blocks: size of the block pool; required for now (see
            ``size_kv_pool_from_free_memory``).
        max_num_seqs: most sequences in one plan.
        max_num_batched_tokens: most tokens in one plan.
        seed: seed of the generator of unseeded random sampling.

    Raises:
        ValueError: a bad argument, or a checkpoint that does not match the model.
    """

    def __init__(self, model_config: ModelConfig, model_path: str | os.PathLike[str], *,
                 device: str | torch.device, dtype: torch.dtype | str, attention_backend: str,
                 block_size: int, num_blocks: int | None, max_num_seqs: int,
                 max_num_batched_tokens: int, seed: int = 0) -> None:
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.model_config = model_config
        self.device = torch.device(device)
        self.dtype = _resolve_dtype(dtype)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.model = self._load_model(model_path, attention_backend)
        self.num_blocks = num_blocks if num_blocks is not None else self.size_kv_pool_from_free_memory()
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        c = model_config
        self.kv_cache = torch.zeros(
            (c.num_hidden_layers, 2, self.num_blocks, block_size, c.num_key_value_heads, c.head_dim),
            dtype=self.dtype, device=self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.sampler = Sampler(self.generator)

    def _load_model(self, model_path: str | os.PathLike[str], attention_backend: str) -> Qwen3ForCausalLM:
        backend = make_attention_backend(attention_backend)
        with _default_dtype(self.dtype), self.device:
            model = Qwen3ForCausalLM(self.model_config, attention_backend=backend)
        load_weights(model, model_path)
        return model.eval()

    def size_kv_pool_from_free_memory(self) -> int:
        """How many KV blocks fit in the device memory left after the weights.

        Raises:
            NotImplementedError: not built yet; pass ``num_blocks`` explicitly.
        """
        raise NotImplementedError(
            "sizing the KV pool from free memory is not implemented yet; pass num_blocks")

    def num_kv_blocks(self) -> int:
        """The size of the block pool."""
        return self.num_blocks

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Write the plan's K/V, run the model, sample for the ``plan.sample`` rows.

        Raises:
            ValueError: the plan does not fit this executor (see ``prepare``).
        """
        if plan.num_seqs == 0:
            return StepResult(sampled={})
        batch, inputs = self.prepare(plan)
        logits = self._logits(batch)  # (S, V)
        if logits.shape[0] == 0:
            return StepResult(sampled={})
        params = [p for p, s in zip(plan.sampling_params, plan.sample) if s]
        # A sampled token's position is its sequence's length so far: the seeded-row counter.
        tensors = SamplingTensors.build(params, inputs.kv_lens[plan.sample], self.model_config.vocab_size,
                                        self.device)
        tokens = self.sampler(logits, tensors).tolist()  # the step's one host sync
        seq_ids = [i for i, s in zip(plan.seq_ids, plan.sample) if s]
        return StepResult(sampled=dict(zip(seq_ids, tokens)))

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> torch.Tensor:
        """Run one step (writing its K/V) and return its sampling rows' logits (S, V), unsampled."""
        batch, _ = self.prepare(plan)
        return self._logits(batch)

    @torch.inference_mode()
    def run_model(self, batch: DeviceBatch) -> torch.Tensor:
        """Write the batch's K/V into the cache and return the hidden states (T, hidden)."""
        return self._forward(batch)

    def _logits(self, batch: DeviceBatch) -> torch.Tensor:
        hidden = self._forward(batch)                                   # (T, hidden)
        return self.model.compute_logits(hidden[batch.sample_indices])  # (S, V)

    def _forward(self, batch: DeviceBatch) -> torch.Tensor:
        # The CUDA graph runner will take decode-only batches here
        # (batch.attn_metadata.is_decode); everything else runs eagerly.
        return self.model(batch.input_ids, batch.positions, batch.attn_metadata)

    def prepare(self, plan: StepPlan) -> tuple[DeviceBatch, BatchInputs]:
        """Compute the plan's index arrays on the host and move them to the device.

        Raises:
            ValueError: the plan exceeds the batch limits, has another block
                size, or names a block outside the pool.
        """
        self._check_plan(plan)
        inputs = prepare_inputs(plan)
        if inputs.block_tables.size and int(inputs.block_tables.max()) >= self.num_blocks:
            raise ValueError(f"a block table names block {int(inputs.block_tables.max())}, "
                             f"but the pool has {self.num_blocks} blocks")
        meta = AttentionMetadata(
            slot_mapping=self._upload(inputs.slot_mapping),
            cu_seqlens_q=self._upload(inputs.cu_seqlens_q),
            kv_lens=self._upload(inputs.kv_lens),
            block_tables=self._upload(inputs.block_tables),
            max_q_len=inputs.max_q_len,
            is_decode=plan.is_decode_only,
            kv_cache=self.kv_cache,
        )
        batch = DeviceBatch(
            input_ids=self._upload(inputs.input_ids),
            positions=self._upload(inputs.positions),
            sample_indices=self._upload(inputs.sample_indices),
            attn_metadata=meta,
        )
        return batch, inputs

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor. On CUDA the copy goes through pinned memory
        and does not block the host (the caching host allocator keeps the pinned
        buffer alive until the copy is done); persistent staging buffers sized by
        max_num_batched_tokens are the next step."""
        t = torch.from_numpy(np.array(array, copy=True))  # a copy: plan arrays are read-only
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _check_plan(self, plan: StepPlan) -> None:
        if plan.block_size != self.block_size:
            raise ValueError(f"plan block_size {plan.block_size} != executor block_size {self.block_size}")
        if plan.num_seqs > self.max_num_seqs:
            raise ValueError(f"plan has {plan.num_seqs} sequences > max_num_seqs {self.max_num_seqs}")
        if plan.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"plan has {plan.num_tokens} tokens > max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
