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

On CUDA two more things happen at start-up: the block pool is sized from the
memory left after a warm-up forward at the largest batch
(``size_kv_pool_from_free_memory``), and decode forwards are captured as CUDA
graphs (``executor/cuda_graph.py``); ``_forward`` is the one place that routes
a decode-only batch to them.

Host -> device: the step's index arrays are packed into one pinned int64
buffer and sent with a single non-blocking copy (see ``_upload_all``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from minivllm.config import ModelConfig, cdiv
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.executor.cuda_graph import CudaGraphRunner, default_capture_sizes
from minivllm.executor.inputs import BatchInputs, prepare_inputs
from minivllm.layers.attention import BACKENDS, AttentionMetadata, make_attention_backend
from minivllm.layers.sampler import Sampler, SamplingTensors
from minivllm.model.loader import load_weights
from minivllm.model.qwen3 import Qwen3ForCausalLM

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


# Largest default KV pool off CUDA (pass num_blocks for another size).
CPU_KV_CACHE_BYTES = 4 << 30


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in ``dtype`` (no float32 copy first); restored on exit."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _resolve_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
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
        num_blocks: size of the block pool; None sizes it from free device
            memory (CUDA only).
        max_num_seqs: most sequences in one plan.
        max_num_batched_tokens: most tokens in one plan.
        max_model_len: most tokens of one sequence (sizes the CUDA-graph block tables).
        seed: seed of the generator of unseeded random sampling.
        enforce_eager: never use CUDA graphs.
        gpu_memory_utilization: fraction of the device's memory this executor may use.
        tensor_parallel_size: only 1 is supported by this executor.

    Raises:
        ValueError: a bad argument, or a checkpoint that does not match the model.
    """

    def __init__(self, model_config: ModelConfig, model_path: str | os.PathLike[str], *,
                 device: str | torch.device, dtype: torch.dtype | str, attention_backend: str,
                 block_size: int, num_blocks: int | None, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int | None = None, seed: int = 0,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1) -> None:
        self.device = torch.device(device)
        if attention_backend == "auto":
            attention_backend = "triton" if self.device.type == "cuda" else "torch"
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
        for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: this executor runs one "
                             "rank; multi-GPU execution is not built yet")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        use_graphs = self.device.type == "cuda" and not enforce_eager
        if use_graphs and attention_backend != "triton":
            raise ValueError("CUDA graphs need attention_backend='triton' (the torch reference "
                             "syncs the host); pass enforce_eager=True to run it eagerly")
        self.model_config = model_config
        self.dtype = _resolve_dtype(dtype, self.device)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.sampler = Sampler(self.generator)
        self._staging: torch.Tensor | None = None   # pinned int64 host buffer (CUDA)
        self._staging_done: torch.cuda.Event | None = None
        self.model = self._load_model(model_path, attention_backend)
        if num_blocks is None:
            num_blocks = self.size_kv_pool_from_free_memory(gpu_memory_utilization)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.kv_cache = self._allocate_kv_cache(num_blocks)
        self.graph_runner: CudaGraphRunner | None = None
        if use_graphs:
            self.graph_runner = CudaGraphRunner(
                self.model.forward, self.kv_cache, model_config.hidden_size,
                cdiv(self.max_model_len, block_size), default_capture_sizes(max_num_seqs))

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        c = self.model_config
        return torch.zeros(
            (c.num_hidden_layers, 2, num_blocks, self.block_size, c.num_key_value_heads, c.head_dim),
            dtype=self.dtype, device=self.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (K and V)."""
        c = self.model_config
        return (c.num_hidden_layers * 2 * self.block_size * c.num_key_value_heads * c.head_dim
                * torch.finfo(self.dtype).bits // 8)

    def _load_model(self, model_path: str | os.PathLike[str], attention_backend: str) -> Qwen3ForCausalLM:
        backend = make_attention_backend(attention_backend)
        with _default_dtype(self.dtype), self.device:
            model = Qwen3ForCausalLM(self.model_config, attention_backend=backend)
        load_weights(model, model_path)
        return model.eval()

    def size_kv_pool_from_free_memory(self, gpu_memory_utilization: float) -> int:
        """How many KV blocks fit in ``gpu_memory_utilization`` of the device.

        Runs a warm-up step at the largest batch (``max_num_batched_tokens``
        tokens, logits and sampling for ``max_num_seqs`` rows) against a
        one-block dummy cache, and counts its peak (weights + activations) as used.

        Raises:
            ValueError: no block fits.

        Off CUDA there is no free-memory figure to go by: the pool holds every
        sequence at full length, at most ``CPU_KV_CACHE_BYTES``.
        """
        if self.device.type != "cuda":
            return self._default_cpu_pool()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warm_up()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)  # other processes, context
        budget = total * gpu_memory_utilization - others - peak
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 1:
            raise ValueError(f"no KV block fits: {budget / 2**30:.2f} GiB left of "
                             f"{gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB after a "
                             f"warm-up peak of {peak / 2**30:.2f} GiB")
        print(f"[minivllm] KV cache: {num_blocks} blocks x {self.block_size} = "
              f"{num_blocks * self.block_size:,} tokens, {num_blocks * self.block_bytes / 2**30:.2f} GiB "
              f"(peak of the warm-up {peak / 2**30:.2f} GiB)")
        return num_blocks

    def _default_cpu_pool(self) -> int:
        """Off CUDA: room for every sequence at full length, capped at CPU_KV_CACHE_BYTES."""
        want = cdiv(self.max_num_seqs * self.max_model_len, self.block_size)
        floor = cdiv(self.max_model_len, self.block_size)  # one full-length sequence always fits
        return max(floor, min(want, CPU_KV_CACHE_BYTES // self.block_bytes))

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """The largest step this executor accepts, over a one-block dummy cache (writes nothing)."""
        from minivllm.sampling import SamplingParams

        t = self.max_num_batched_tokens
        seq_len = min(t, self.max_model_len)
        num_seqs = cdiv(t, seq_len)
        q_lens = [seq_len] * (num_seqs - 1) + [t - seq_len * (num_seqs - 1)]
        cu = torch.tensor([0] + list(np.cumsum(q_lens)), dtype=torch.int32, device=self.device)
        dummy = self._allocate_kv_cache(1)
        meta = AttentionMetadata(
            slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=self.device),
            cu_seqlens_q=cu, kv_lens=torch.tensor(q_lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(num_seqs, cdiv(seq_len, self.block_size), dtype=torch.int32,
                                     device=self.device),
            max_q_len=max(q_lens), is_decode=False, kv_cache=dummy)
        ids = torch.zeros(t, dtype=torch.int64, device=self.device)
        pos = torch.arange(t, device=self.device) % seq_len
        hidden = self.model(ids, pos, meta)
        rows = min(self.max_num_seqs, t)
        logits = self.model.compute_logits(hidden[:rows])
        params = [SamplingParams(top_k=50, top_p=0.9, min_p=0.05, seed=i % 2 or None)
                  for i in range(rows)]
        tensors = SamplingTensors.build(params, np.full(rows, seq_len), self.model_config.vocab_size,
                                        self.device)
        self.sampler(logits, tensors)
        del hidden, logits, dummy

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
        logits = self._logits(batch, inputs)  # (S, V)
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
        batch, inputs = self.prepare(plan)
        return self._logits(batch, inputs)

    @torch.inference_mode()
    def run_model(self, batch: DeviceBatch, inputs: BatchInputs) -> torch.Tensor:
        """Write the batch's K/V into the cache and return the hidden states (T, hidden)."""
        return self._forward(batch, inputs)

    def _logits(self, batch: DeviceBatch, inputs: BatchInputs) -> torch.Tensor:
        hidden = self._forward(batch, inputs)                           # (T, hidden)
        return self.model.compute_logits(hidden[batch.sample_indices])  # (S, V)

    def _forward(self, batch: DeviceBatch, inputs: BatchInputs) -> torch.Tensor:
        """Decode-only batches that a captured graph covers replay it; the rest run eagerly."""
        meta = batch.attn_metadata
        if self.graph_runner is not None and meta.is_decode and self.graph_runner.can_run(inputs):
            return self.graph_runner.run(inputs, {
                "input_ids": batch.input_ids, "positions": batch.positions,
                "slot_mapping": meta.slot_mapping, "kv_lens": meta.kv_lens,
                "block_tables": meta.block_tables})
        return self.model(batch.input_ids, batch.positions, meta)

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
        ids, pos, slots, sample, cu_q, kv_lens, tables = self._upload_all(
            inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.sample_indices,
            inputs.cu_seqlens_q, inputs.kv_lens, inputs.block_tables)
        meta = AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=cu_q.to(torch.int32), kv_lens=kv_lens.to(torch.int32),
            block_tables=tables.to(torch.int32), max_q_len=inputs.max_q_len,
            is_decode=plan.one_token_per_seq, kv_cache=self.kv_cache)
        batch = DeviceBatch(input_ids=ids, positions=pos, sample_indices=sample, attn_metadata=meta)
        return batch, inputs

    def _upload_all(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Host arrays -> int64 device tensors of the same shapes, in ONE copy.

        On CUDA the arrays are packed into a persistent pinned buffer and sent
        with a single non-blocking copy (one transfer instead of seven). Before
        the buffer is rewritten, the host waits on the event of the previous
        copy: normally long done, since each step ends with a host sync.
        """
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self.device.type == "cpu":
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64))
        else:
            if self._staging is None or self._staging.numel() < total:
                self._staging = torch.empty(max(total, 1 << 16), dtype=torch.int64, pin_memory=True)
            elif self._staging_done is not None:
                self._staging_done.synchronize()
            np.concatenate([a.reshape(-1) for a in arrays], out=self._staging.numpy()[:total],
                           casting="unsafe")
            flat = self._staging[:total].to(self.device, non_blocking=True)
            self._staging_done = torch.cuda.Event()
            self._staging_done.record()
        parts = torch.split(flat, sizes)
        return [p.view(a.shape) for p, a in zip(parts, arrays)]

    def _check_plan(self, plan: StepPlan) -> None:
        if plan.block_size != self.block_size:
            raise ValueError(f"plan block_size {plan.block_size} != executor block_size {self.block_size}")
        if plan.num_seqs > self.max_num_seqs:
            raise ValueError(f"plan has {plan.num_seqs} sequences > max_num_seqs {self.max_num_seqs}")
        if plan.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"plan has {plan.num_tokens} tokens > max_num_batched_tokens "
                             f"{self.max_num_batched_tokens}")
