"""``ModelExecutor``: the real Qwen3 behind the ``Executor`` protocol.

One step::

    StepPlan --prepare_inputs (numpy)--> BatchInputs --upload--> DeviceBatch
             --model--> hidden (T, hidden) --rows sample_indices--> logits (S, V)
             --sampler--> token ids (S,) --> prev_sampled (device, next step's references)
                                         --> pinned host buffer + event --> StepResult

``submit`` enqueues all of it and returns; ``result()`` waits on the event. So
the engine can plan and submit step N+1 while the device runs step N, and the
tokens step N+1 feeds by reference never leave the device.

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
buffer and sent with a single non-blocking copy (see ``_upload_all``);
device -> host: one copy of the sampled ids per step.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

import numpy as np
import torch

from minivllm.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig, cdiv
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.executor.base import DoneStep, StepHandle
from minivllm.executor.cuda_graph import CudaGraphRunner, default_capture_sizes
from minivllm.executor.device_batch import DeviceBatch, resolve_input_ids
from minivllm.executor.inputs import BatchInputs, prepare_inputs
from minivllm.layers.attention import AttentionMetadata, make_attention_backend
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


class _CudaStep:
    """A submitted CUDA step: its sampled ids land in a pinned host buffer behind an event."""

    def __init__(self, seq_ids: list[int], host: torch.Tensor, done: torch.cuda.Event) -> None:
        self.seq_ids = seq_ids
        self.host = host
        self.done = done

    def result(self) -> StepResult:
        self.done.synchronize()  # the one wait per step: by now usually already past
        return StepResult(sampled=dict(zip(self.seq_ids, self.host.tolist())))


class ModelExecutor:
    """Runs ``StepPlan``s on Qwen3 over a paged KV cache it owns.

    Args:
        model_config: the model's shapes.
        model_path: directory of the safetensors checkpoint.
        scheduler_config: batch limits (max_num_seqs, max_num_batched_tokens,
            max_model_len: sizes the CUDA-graph block tables).
        cache_config: block size and pool size (None: sized from free device
            memory on CUDA; every sequence at full length elsewhere).
        config: device, dtype, attention backend, seed, graphs, memory share,
            tensor-parallel size.
        tp_rank: this process's rank when ``config.tensor_parallel_size > 1``
            (``executor/distributed.py`` builds one executor per rank, inside a
            process group).
        agree_num_blocks: with several ranks, maps this rank's pool size to the
            one all ranks use (the minimum over ranks).

    Raises:
        ValueError: a bad setting, or a checkpoint that does not match the model.
    """

    def __init__(self, model_config: ModelConfig, model_path: str | os.PathLike[str],
                 scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 config: ExecutorConfig = ExecutorConfig(), tp_rank: int = 0,
                 agree_num_blocks: Callable[[int], int] | None = None) -> None:
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        backend = config.attention_backend
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        self.tp_rank, self.tp_size = tp_rank, config.tensor_parallel_size
        if self.tp_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError(f"tensor_parallel_size={self.tp_size} needs a process group: build it with "
                             "LLM(..., tensor_parallel_size=N) (minivllm/executor/distributed.py)")
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if use_graphs and backend != "triton":
            raise ValueError("CUDA graphs need attention_backend='triton' (the torch reference "
                             "syncs the host); pass enforce_eager=True to run it eagerly")
        self.model_config = model_config
        self.config = config
        self.dtype = _resolve_dtype(config.dtype, self.device)
        if self.device.type == "cuda":
            # cuBLAS may otherwise sum split-K partials of bf16 GEMMs in bf16, which at decode
            # batch sizes costs far more accuracy than HF's batch-1 GEMMs lose (issue 7).
            # Process-wide: set before any GEMM is captured into a graph.
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        self.block_size = cache_config.block_size
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = min(scheduler_config.max_model_len, model_config.max_position_embeddings)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.sampler = Sampler(self.generator)
        self.model = self._load_model(model_path, backend)
        # This rank's KV heads (all of them, a shard, or one replicated head).
        self.num_kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        num_blocks = cache_config.num_blocks
        if num_blocks is None:
            num_blocks = self.size_kv_pool_from_free_memory(config.gpu_memory_utilization)
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
        self.num_blocks = num_blocks
        self.kv_cache = self._allocate_kv_cache(num_blocks)
        # The last step's sampled ids, by sampling row (``prev_sample_row`` maps sequences to rows).
        self.prev_sampled = torch.zeros(self.max_num_seqs, dtype=torch.int64, device=self.device)
        self.prev_sample_row: dict[int, int] = {}
        self.keep_logits = False
        self.last_logits: torch.Tensor | None = None
        self._staging = _PinnedRing(self.device)
        self._outputs = _PinnedRing(self.device)
        self.graph_runner: CudaGraphRunner | None = None
        if use_graphs:
            self.graph_runner = CudaGraphRunner(
                self.model.forward, self.kv_cache, self.prev_sampled, model_config.hidden_size,
                cdiv(self.max_model_len, self.block_size), default_capture_sizes(self.max_num_seqs))

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        c = self.model_config
        return torch.zeros(
            (c.num_hidden_layers, 2, num_blocks, self.block_size, self.num_kv_heads, c.head_dim),
            dtype=self.dtype, device=self.device)

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers (K and V)."""
        c = self.model_config
        return (c.num_hidden_layers * 2 * self.block_size * self.num_kv_heads * c.head_dim
                * torch.finfo(self.dtype).bits // 8)

    def _load_model(self, model_path: str | os.PathLike[str], attention_backend: str) -> Qwen3ForCausalLM:
        backend = make_attention_backend(attention_backend)
        with _default_dtype(self.dtype), self.device:
            model = Qwen3ForCausalLM(self.model_config, attention_backend=backend,
                                     tp_rank=self.tp_rank, tp_size=self.tp_size)
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
        # Each sampler path once: compiled before the first request, and the full-vocab
        # sort of a top-p-only batch (the sampler's memory peak) counted in the peak.
        batches = ([SamplingParams(top_k=50, top_p=0.9, min_p=0.05, seed=i % 2 or None) for i in range(rows)],
                   [SamplingParams()] * rows, [SamplingParams(top_p=0.9)] * rows,
                   [SamplingParams(temperature=0.0)] * rows)
        for params in batches:
            tensors = SamplingTensors.build(params, np.full(rows, seq_len), self.model_config.vocab_size,
                                            self.device)
            self.sampler(logits, tensors)
        del hidden, logits, dummy

    def num_kv_blocks(self) -> int:
        """The size of the block pool."""
        return self.num_blocks

    def execute(self, plan: StepPlan) -> StepResult:
        """``submit(plan).result()``."""
        return self.submit(plan).result()

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> StepHandle:
        """Enqueue the step (inputs up, model, sampler, ids down) and return without waiting.

        On CUDA nothing here waits for the device: the inputs go up from pinned
        memory, referenced tokens are gathered from ``prev_sampled`` on the
        device, and the sampled ids come down into a pinned buffer behind an
        event that ``result()`` waits on. Elsewhere the step runs to completion.

        Raises:
            ValueError: the plan does not fit this executor (see ``prepare``).
        """
        if plan.num_seqs == 0:
            return DoneStep(StepResult(sampled={}))
        batch, inputs = self.prepare(plan)
        logits = self._logits(batch, inputs)  # (S, V)
        seq_ids = [i for i, s in zip(plan.seq_ids, plan.sample) if s]
        if not seq_ids:
            self.prev_sample_row = {}  # the next plan can refer to nothing of this one
            return DoneStep(StepResult(sampled={}))
        params = [p for p, s in zip(plan.sampling_params, plan.sample) if s]
        # A sampled token's position is its sequence's length so far: the seeded-row counter.
        tensors = SamplingTensors.build(params, inputs.kv_lens[plan.sample], self.model_config.vocab_size,
                                        self.device)
        if self.keep_logits:  # tests: TP logits against TP=1 (distributed.TPExecutor.compute_logits)
            self.last_logits = logits
        tokens = self.sampler(logits, tensors)        # (S,) int64 on the device
        self.prev_sampled[:len(seq_ids)].copy_(tokens)
        self.prev_sample_row = {sid: row for row, sid in enumerate(seq_ids)}
        if self.device.type != "cuda":
            return DoneStep(StepResult(sampled=dict(zip(seq_ids, tokens.tolist()))))
        host = self._outputs.next(len(seq_ids))
        host.copy_(tokens, non_blocking=True)
        return _CudaStep(seq_ids, host, self._outputs.record())

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> torch.Tensor:
        """Run one step (writing its K/V) and return its sampling rows' logits (S, V), unsampled."""
        batch, inputs = self.prepare(plan)
        return self._logits(batch, inputs)

    @torch.inference_mode()
    def run_model(self, batch: DeviceBatch, inputs: BatchInputs) -> torch.Tensor:
        """Write the batch's K/V into the cache and return the hidden states (T, hidden)."""
        return self._forward(batch)

    def _logits(self, batch: DeviceBatch, inputs: BatchInputs) -> torch.Tensor:
        hidden = self._forward(batch)                                   # (T, hidden)
        return self.model.compute_logits(hidden[batch.sample_indices])  # (S, V)

    def _forward(self, batch: DeviceBatch) -> torch.Tensor:
        """Batches of one token per sequence that a captured graph covers replay it; the rest
        run eagerly."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        ids = resolve_input_ids(batch.input_ids, batch.prev_rows, self.prev_sampled)
        return self.model(ids, batch.positions, batch.attn_metadata)

    def prepare(self, plan: StepPlan) -> tuple[DeviceBatch, BatchInputs]:
        """Compute the plan's index arrays on the host and move them to the device.

        Raises:
            ValueError: the plan exceeds the batch limits, has another block
                size, names a block outside the pool, or feeds a sequence a
                previous-step token that the previous step did not sample.
        """
        self._check_plan(plan)
        inputs = prepare_inputs(plan)
        if inputs.block_tables.size and int(inputs.block_tables.max()) >= self.num_blocks:
            raise ValueError(f"a block table names block {int(inputs.block_tables.max())}, "
                             f"but the pool has {self.num_blocks} blocks")
        ids, prev_rows, pos, slots, sample, cu_q, kv_lens, tables = self._upload_all(
            inputs.input_ids, self._prev_rows(plan), inputs.positions, inputs.slot_mapping,
            inputs.sample_indices, inputs.cu_seqlens_q, inputs.kv_lens, inputs.block_tables)
        meta = AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=cu_q.to(torch.int32), kv_lens=kv_lens.to(torch.int32),
            block_tables=tables.to(torch.int32), max_q_len=inputs.max_q_len,
            is_decode=plan.one_token_per_seq, kv_cache=self.kv_cache)
        batch = DeviceBatch(input_ids=ids, prev_rows=prev_rows, positions=pos, sample_indices=sample,
                            attn_metadata=meta, num_seqs=plan.num_seqs,
                            table_width=inputs.block_tables.shape[1])
        return batch, inputs

    def _prev_rows(self, plan: StepPlan) -> np.ndarray:
        """int64 (T,): for each token fed by reference, its row in ``prev_sampled``; -1 elsewhere."""
        rows = np.full(plan.num_tokens, -1, dtype=np.int64)
        if plan.feeds_prev_sample.any():
            refs = np.asarray(plan.seq_ids)[plan.feeds_prev_sample].tolist()
            missing = [sid for sid in refs if sid not in self.prev_sample_row]
            if missing:
                raise ValueError(f"plan feeds sequence(s) {missing[:8]} the previous step's sample, "
                                 "but the previous step did not sample for them")
            rows[plan.prev_sample_slots] = [self.prev_sample_row[sid] for sid in refs]
        return rows

    def _upload_all(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Host arrays -> int64 device tensors of the same shapes, in ONE copy.

        On CUDA the arrays are packed into a pinned buffer (a ring of two, so the
        host never rewrites one the previous step's copy may still read) and
        sent with a single non-blocking copy.
        """
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self.device.type == "cpu":
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64))
        else:
            staging = self._staging.next(total)
            np.concatenate([a.reshape(-1) for a in arrays], out=staging.numpy(), casting="unsafe")
            flat = staging.to(self.device, non_blocking=True)
            self._staging.record()
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


class _PinnedRing:
    """Two pinned int64 host buffers used in turn, each behind the event of its last copy.

    With one step in flight, a buffer is reused two steps later; waiting on its
    event before rewriting it costs nothing then, and makes reuse safe always.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def next(self, size: int) -> torch.Tensor:
        """A pinned (size,) int64 view, free to write."""
        self.turn ^= 1
        buf, event = self.buffers[self.turn], self.events[self.turn]
        if buf is None or buf.numel() < size:
            buf = torch.empty(max(size, 1 << 16), dtype=torch.int64, pin_memory=True)
            self.buffers[self.turn] = buf
        elif event is not None:
            event.synchronize()
        return buf[:size]

    def record(self) -> torch.cuda.Event:
        """Mark the current buffer's copy as enqueued (call right after it); returns its event."""
        event = torch.cuda.Event()
        event.record()
        self.events[self.turn] = event
        return event
