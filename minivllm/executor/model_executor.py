"""``ModelExecutor``: the real Qwen3 behind the ``Executor`` protocol.

One step::

    StepPlan --prepare_inputs (numpy)--> BatchInputs --upload--> DeviceBatch
             --model--> hidden (T, hidden) --rows sample_indices--> logits (S, V)
             --[penalties]--sampler--> token ids (S,) --> prev_sampled (device, next step's references)
                                      [+ logprobs of the raw logits, prompt logprobs of hidden rows]
                                      --> pinned host buffer + event --> StepResult

``submit`` enqueues all of it and returns; ``result()`` waits on the event. So
the engine can plan and submit step N+1 while the device runs step N, and the
tokens step N+1 feeds by reference never leave the device.

The KV cache is ONE tensor for all layers::

    kv_cache  (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
              kv_cache[l, 0] = layer l's K cache, kv_cache[l, 1] = its V cache

so each layer's K (or V) cache is a contiguous (num_blocks, block_size, Hkv, D)
view, token slot s living at [s // block_size, s % block_size]. Its dtype is the model's,
or e4m3 with ``kv_cache_dtype="fp8"`` (``layers/attention.py``), which halves
``block_bytes`` and so doubles the blocks the same memory holds.

A hybrid model (Qwen3.5, Qwen3-Next: ``ModelConfig.is_hybrid``) keeps K/V only for its full-attention
layers (``ModelConfig.num_attention_layers`` rows, each layer at its ``kind_index``) and,
beside them, its linear-attention layers' recurrent states: slots, prefix-cache snapshots and
a drafted row's per-position states in one tensor pair (``executor/linear_state.py``), which
each step's plan indexes (``StepPlan.state_*``). A hybrid model's steps replay CUDA graphs as
any model's, the state slots and save points in static buffers (``executor/prefill_graph.py``).

The executor builds the model's ``Ops`` once (``ops/dispatch.py``: Triton kernels or torch
references, PDL, the tensor-parallel communicator) and hands it to the model.

On CUDA two more things happen at start-up: the block pool is sized from the
memory left after a warm-up forward at the largest batch
(``size_kv_pool_from_free_memory``), and decode forwards are captured as CUDA
graphs (``executor/cuda_graph.py``), the other steps too, per token bucket
(``executor/prefill_graph.py``); ``_forward`` is the one place that routes a
batch to them. ``close`` gives all of it back.

Host -> device: the step's index arrays are packed into one pinned int64
buffer and sent with a single non-blocking copy (see ``_upload_all``), and the
optional sampler inputs (penalty histories, logprob rows, prompt-logprob
targets) with one more when a step has any (``_extras``); device -> host: one
copy per step of the sampled ids, with any logprobs packed behind them
(``_StepOutputs``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Callable, Iterator

import numpy as np
import torch

from minivllm.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, cdiv
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.executor.base import DoneStep, StepHandle
from minivllm.executor.cuda_graph import CudaGraphRunner, default_capture_sizes
from minivllm.executor.device_batch import DeviceBatch, referenced_tokens, resolve_input_ids
from minivllm.executor.draft import DraftRunner, check_draft_config
from minivllm.executor.inputs import BatchInputs, prepare_inputs
from minivllm.executor.linear_state import (SNAPSHOT_MEMORY_SHARE, SNAPSHOTS_PER_SEQ, LinearStates, StateInputs,
                                            StateLayout, check_no_state_fields, state_bytes)
from minivllm.executor.mtp import MtpRunner
from minivllm.executor.prefill_graph import PrefillGraphRunner, default_prefill_buckets
from minivllm.layers.attention import kv_cache_torch_dtype
from minivllm.layers.linear_attention import allocate_linear_state
from minivllm.layers.linear import quantize_to_fp8
from minivllm.layers.weights import check_tp_divisibility
from minivllm.model.decoder import DecoderForCausalLM
from minivllm.model.hf_config import read_model_config
from minivllm.model.loader import fill_dummy_weights, load_weights, require_weights
from minivllm.model.qwen3_5 import Qwen3_5ForCausalLM
from minivllm.model.qwen3_5_mtp import attach_mtp
from minivllm.model.registry import build_model
from minivllm.ops.communicator import Communicator, build_communicator
from minivllm.ops.dispatch import Ops, hashed_uniform, row_keys
from minivllm.ops.metadata import AttentionMetadata, StateMetadata
from minivllm.sampler import rejection
from minivllm.sampler.logprobs import SLICE_ROWS, LogprobLayout, LogprobTensors, sliced_logprobs
from minivllm.sampler.penalties import PenaltyInputs, PenaltyTensors
from minivllm.sampler.sampler import Sampler, SamplingTensors, apply_logit_bias, apply_token_bitmask
from minivllm.sampling import MAX_LOGPROBS, SamplingParams
from minivllm.step_types import TokenHistory

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


# Largest default KV pool off CUDA (pass num_blocks for another size).
CPU_KV_CACHE_BYTES = 4 << 30
_LOGPROBS = attrgetter("logprobs")
_SHAPES_LOGITS = attrgetter("shapes_logits")
_ACCEPT_SALT = 0x2545F491  # keys of the acceptance tests, apart from the draws' (same seed, position)


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
class _Extras:
    """A step's optional sampler inputs on the device (one upload), with their host layouts.

    All None when no row asks for penalties, logprobs or prompt logprobs.
    """

    penalties: PenaltyTensors | None
    logprobs: LogprobLayout | None          # sampling sequences reporting logprobs, one row each
    logprob_rows: torch.Tensor | None       # int64 (L,): their sampling rows; None: all S rows
    prompt: LogprobLayout | None            # sequences with prompt-logprob targets, P rows each
    prompt_rows: torch.Tensor | None        # int64 (N,): token row (of the hidden states) of each target
    prompt_targets: torch.Tensor | None     # int64 (N,): the prompt token that row predicts


def _gather_logprob_rows(seq_ids: list[int], params: list[SamplingParams], scored: np.ndarray | None = None
                         ) -> tuple[LogprobLayout | None, np.ndarray | None]:
    """Layout of the sampling rows that report logprobs, and their rows (None: all of them or none).
    ``scored``: positions scored per sampling row (1 + its drafts; None: one each)."""
    ks = list(map(_LOGPROBS, params))
    if ks.count(None) == len(ks):  # the common case, in C
        return None, None
    asking = [i for i, k in enumerate(ks) if k is not None]
    layout = LogprobLayout(seq_ids=tuple(seq_ids[i] for i in asking),
                           num_rows=(1,) * len(asking) if scored is None else tuple(int(scored[i]) for i in asking),
                           ks=tuple(ks[i] for i in asking))
    return layout, (np.asarray(asking, dtype=np.int64) if len(asking) < len(ks) else None)


@dataclass(frozen=True)
class _StepOutputs:
    """What a step brings to the host, as ONE int64 vector, and how to read it::

        sampled ids (S) | sampled tokens' logprobs (packed) | prompt logprobs (packed)

    (``LogprobTensors.packed``; a block is absent when its layout is None).
    """

    seq_ids: list[int]                      # the sampling sequences, in row order
    logprobs: LogprobLayout | None
    prompt_logprobs: LogprobLayout | None
    # Sequences with drafts: their accepted counts follow the sampled ids (S more values).
    drafted: list[int] | None = None
    # Drafts made on the device (``StepPlan.drafts_on_device``): each drafted sequence's
    # count, in ``drafted``'s order; the drafts follow the accepted counts.
    made: list[int] | None = None

    def unpack(self, flat: np.ndarray) -> StepResult:
        s = len(self.seq_ids)
        blocks: dict[str, Any] = {}
        offset = s
        if self.drafted is not None:
            counts = dict(zip(self.seq_ids, flat[s:2 * s].tolist()))
            blocks["num_accepted"] = {sid: counts[sid] for sid in self.drafted}
            offset += s
        if self.made is not None:
            assert self.drafted is not None
            drafts = {}
            for sid, d in zip(self.drafted, self.made):
                drafts[sid] = flat[offset:offset + d].tolist()
                offset += d
            blocks["drafts"] = drafts
        for name, layout in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if layout is not None:
                blocks[name] = layout.unpack(flat[offset:offset + layout.size])
                offset += layout.size
        return StepResult(sampled=dict(zip(self.seq_ids, flat[:s].tolist())), **blocks)


class _CudaStep:
    """A submitted CUDA step: its results land in a pinned host buffer behind an event."""

    def __init__(self, outputs: _StepOutputs, host: torch.Tensor, done: torch.cuda.Event) -> None:
        self.outputs = outputs
        self.host = host
        self.done = done

    def ready(self) -> bool:
        """Whether the step has finished (no wait): a caller that must stay responsive
        while it waits polls this (``distributed._CheckedHandle``)."""
        return self.done.query()

    def result(self) -> StepResult:
        self.done.synchronize()  # the one wait per step: by now usually already past
        return self.outputs.unpack(self.host.numpy())


class _MaskedStep:
    """A submitted step whose forward is running and whose sampler waits for the token bitmask."""

    def __init__(self, finish: Callable[[np.ndarray], StepHandle], executor: "ModelExecutor") -> None:
        self._finish: Callable[[np.ndarray], StepHandle] | None = finish
        self._executor = executor
        self._handle: StepHandle | None = None

    def set_token_bitmask(self, bitmask: np.ndarray) -> None:
        if self._finish is None:
            raise RuntimeError("the token bitmask of this step was already given")
        finish, self._finish = self._finish, None
        self._executor._awaiting_bitmask = None
        # The sampler runs now, after submit returned: under inference mode as submit's own
        # steps are (on CUDA the results land in a pinned buffer made under it).
        with torch.inference_mode():
            self._handle = finish(bitmask)

    def result(self) -> StepResult:
        if self._handle is None:
            raise RuntimeError("result() of a step with masked rows before its token bitmask was given")
        return self._handle.result()


class ModelExecutor:
    """Runs ``StepPlan``s on Qwen3 over a paged KV cache it owns.

    Args:
        model_config: the model's shapes.
        model_path: directory of the safetensors checkpoint.
        scheduler_config: batch limits (max_num_seqs, max_num_batched_tokens,
            max_model_len: sizes the CUDA-graph block tables).
        cache_config: block size and pool size (None: sized from free device
            memory on CUDA; every sequence at full length elsewhere).
        config: device, dtype, kernels, seed, graphs, memory share,
            tensor-parallel size.
        tp_rank: this process's rank when ``config.tensor_parallel_size > 1``
            (``executor/distributed.py`` builds one executor per rank, inside a
            process group).
        agree_num_blocks: with several ranks, maps this rank's pool size (and a hybrid
            model's snapshot count) to the one all ranks use (the minimum over ranks).
        speculative_config: with method ``draft_model``, the draft model (its directory
            resolved) runs in this executor (``executor/draft.py``); other methods need
            nothing here.

    Raises:
        ValueError: a bad setting, or a checkpoint that does not match the model.
    """

    def __init__(self, model_config: ModelConfig, model_path: str | os.PathLike[str],
                 scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 config: ExecutorConfig = ExecutorConfig(), tp_rank: int = 0,
                 agree_num_blocks: Callable[[int], int] | None = None,
                 speculative_config: SpeculativeConfig | None = None) -> None:
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tp_rank, self.tp_size = tp_rank, config.tensor_parallel_size
        if self.tp_size > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ValueError(f"tensor_parallel_size={self.tp_size} needs a process group: build it with "
                             "LLM(..., tensor_parallel_size=N) (minivllm/executor/distributed.py)")
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp_rank must be in [0, {self.tp_size}), got {tp_rank}")
        self.model_config = model_config
        self.config = config
        self.dtype = _resolve_dtype(config.dtype, self.device)
        comm, self.all_reduce_path = self._communicator(config)
        self.ops = Ops.build(config.kernels, self.device, self.dtype, comm)
        use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if use_graphs and not self.ops.triton:
            raise ValueError("CUDA graphs need kernels='triton' (the torch references sync the host); "
                             "pass enforce_eager=True to run them eagerly")
        if self.device.type == "cuda":
            # cuBLAS may otherwise sum split-K partials of bf16 GEMMs in bf16. Measured, no GEMM
            # shape here lost accuracy to it, so off costs nothing and rules it out (docs/tuning.md,
            # "Rounding and precision"). Process-wide: set before any GEMM is captured into a graph.
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        self.block_size = cache_config.block_size
        self.kv_dtype = kv_cache_torch_dtype(cache_config, self.dtype)
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = min(scheduler_config.max_model_len, model_config.max_position_embeddings)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.sampler = Sampler(self.ops, self.generator)
        self.use_mtp = use_mtp = speculative_config is not None and speculative_config.method == "mtp"
        self.model = self._load_model(model_path, model_config, mtp=use_mtp)
        self.draft_config: ModelConfig | None = None  # the second KV cache's model: a draft model or MTP head
        self.draft_model: DecoderForCausalLM | None = None
        if speculative_config is not None and speculative_config.method == "draft_model":
            assert speculative_config.model is not None
            self.draft_config = read_model_config(speculative_config.model)
            check_draft_config(self.draft_config, model_config, self.max_model_len)
            if self.tp_size > 1:
                check_tp_divisibility(self.draft_config, self.tp_size)
            self.draft_model = self._load_model(speculative_config.model, self.draft_config)
        if use_mtp:
            self.draft_config = self.model.mtp.config  # type: ignore[union-attr]
        # This rank's KV heads (all of them, a shard, or one replicated head).
        self.num_kv_heads = _first_attention(self.model).num_kv_heads
        max_drafts = speculative_config.num_speculative_tokens if speculative_config is not None else 0
        # Snapshots serve prefix-cache hits only: none without the cache, its memory left to KV blocks.
        snapshots = SNAPSHOTS_PER_SEQ * self.max_num_seqs if cache_config.enable_prefix_caching else 0
        self.state_layout: StateLayout | None = (
            StateLayout(self.max_num_seqs, snapshots, max_drafts) if model_config.is_hybrid else None)
        num_blocks = cache_config.num_blocks
        if num_blocks is None:
            num_blocks, num_snapshots = self.size_kv_pool_from_free_memory(config.gpu_memory_utilization)
            if self.state_layout is not None:
                self.state_layout = dataclasses.replace(self.state_layout, num_snapshots=num_snapshots)
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
            if self.state_layout is not None:  # the engine indexes every rank's snapshots alike
                self.state_layout = dataclasses.replace(
                    self.state_layout, num_snapshots=agree_num_blocks(self.state_layout.num_snapshots))
        self.num_blocks = num_blocks
        self.kv_cache = self._allocate_kv_cache(num_blocks)
        self.states = (LinearStates(model_config, self.state_layout, self.dtype, self.device, self.tp_size,
                                    hidden=use_mtp) if self.state_layout is not None else None)
        self._keep_staging = _PinnedRing(self.device)  # a drafted hybrid step's kept-state indices
        # The last step's sampled ids, by sampling row (``prev_sample_row`` maps sequences to rows).
        self.prev_sampled = torch.zeros(self.max_num_seqs, dtype=torch.int64, device=self.device)
        self.prev_sample_row: dict[int, int] = {}
        self._awaiting_bitmask: _MaskedStep | None = None  # a step whose sampler waits for its masks
        self._staging = _PinnedRing(self.device)
        self._extras_staging = _PinnedRing(self.device)  # its own ring: one upload a step each
        self._mask_staging = _PinnedRing(self.device)
        self._scoring_staging = _PinnedRing(self.device)  # a drafted step's scoring indices
        self._outputs = _PinnedRing(self.device)
        self.drafter: DraftRunner | None = None
        if self.draft_model is not None:
            assert self.draft_config is not None and speculative_config is not None
            self._draft_staging = _PinnedRing(self.device)
            self.drafter = DraftRunner(
                self.draft_model, self.draft_config, self._allocate_kv_cache(num_blocks, draft=True),
                speculative_config.num_speculative_tokens, self.dtype, self.prev_sampled, self.max_num_seqs,
                cdiv(self.max_model_len, self.block_size), use_graphs)
        self.mtp_runner: MtpRunner | None = None
        if use_mtp:
            assert isinstance(self.model, Qwen3_5ForCausalLM) and self.states is not None
            self._draft_staging, self._mtp_staging = _PinnedRing(self.device), _PinnedRing(self.device)
            self.mtp_runner = MtpRunner(self.model, self._allocate_kv_cache(num_blocks, draft=True), self.states,
                                        self.prev_sampled, speculative_config.num_speculative_tokens,  # type: ignore[union-attr]
                                        self.max_num_seqs, cdiv(self.max_model_len, self.block_size), use_graphs)
        self.graph_runner: CudaGraphRunner | None = None
        self.prefill_graph_runner: PrefillGraphRunner | None = None
        if use_graphs:
            self.graph_runner = CudaGraphRunner(
                self.model.forward, self.kv_cache, self.prev_sampled, model_config.hidden_size, self.dtype,
                cdiv(self.max_model_len, self.block_size), default_capture_sizes(self.max_num_seqs), self.states)
            self.prefill_graph_runner = self.make_prefill_graph_runner(capture=True)

    def _communicator(self, config: ExecutorConfig) -> tuple[Communicator | None, str]:
        """This rank's tensor-parallel communicator (None with one rank) and how its all-reduces
        travel, in words (``all_reduce_path``); built before the model (its ops hold it, and
        graphs bake it in)."""
        if self.tp_size == 1:
            return None, "none (one rank)"
        comm, why_not = build_communicator(self.device, self.dtype,
                                           custom_all_reduce=not config.disable_custom_all_reduce)
        return comm, comm.path + (f" ({why_not})" if why_not else "")

    def close(self) -> None:
        """Give back everything this executor holds on the device: CUDA graphs and their memory
        pools, the KV pool, the model's weights, the communicator's buffers, pinned buffers.
        Idempotent; the executor runs no step after it."""
        if self.model is None:
            return
        self.graph_runner = None
        self.prefill_graph_runner = None
        self.drafter = self.draft_model = self.mtp_runner = None
        if self.ops.comm is not None:
            self.ops.comm.close()
        self.model = None  # type: ignore[assignment]
        self.kv_cache = None  # type: ignore[assignment]
        self.states = None
        self.prev_sampled = None  # type: ignore[assignment]
        self._staging = self._extras_staging = self._outputs = self._mask_staging = None  # type: ignore[assignment]
        self._awaiting_bitmask = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    @property
    def captures_prefill_graphs(self) -> bool:
        """Whether prefill and mixed steps replay CUDA graphs (on CUDA unless ``enforce_eager``)."""
        return self.prefill_graph_runner is not None

    def make_prefill_graph_runner(self, capture: bool, buckets: list[int] | None = None) -> PrefillGraphRunner:
        """A runner of prefill and mixed steps in token buckets (default: ``default_prefill_buckets``);
        ``capture=False`` runs the padded forward eagerly (the CPU, tests)."""
        attn = _first_attention(self.model)
        return PrefillGraphRunner(
            self.model.forward, self.kv_cache, self.prev_sampled, self.model_config.hidden_size, self.dtype,
            attn.num_heads, self.num_kv_heads, self.model_config.head_dim, self.max_num_seqs,
            cdiv(self.max_model_len, self.block_size),
            buckets or default_prefill_buckets(self.max_num_batched_tokens, hybrid=self.model_config.is_hybrid),
            capture, self.states)

    def _allocate_kv_cache(self, num_blocks: int, draft: bool = False) -> torch.Tensor:
        """This rank's KV cache of the target, or with ``draft`` of the draft model."""
        c, heads = self._cache_shape(draft)
        return torch.zeros((c.num_attention_layers, 2, num_blocks, self.block_size, heads, c.head_dim),
                           dtype=self.kv_dtype, device=self.device)

    def _cache_shape(self, draft: bool) -> tuple[ModelConfig, int]:
        """The model whose cache it is, and this rank's KV heads of it (all, a shard, or one
        replicated head)."""
        if not draft:
            return self.model_config, self.num_kv_heads
        assert self.draft_config is not None
        if self.draft_model is None:  # the MTP head's one layer
            return self.draft_config, self.model.mtp.layers[0].self_attn.num_kv_heads  # type: ignore[union-attr]
        return self.draft_config, _first_attention(self.draft_model).num_kv_heads

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block over all layers with K/V (a hybrid model's full-attention
        layers), the draft model's included."""
        size = 0
        for draft in (False, True) if self.draft_config is not None else (False,):
            c, heads = self._cache_shape(draft)
            size += c.num_attention_layers * 2 * self.block_size * heads * c.head_dim * torch.finfo(self.kv_dtype).bits // 8
        return size

    def _load_model(self, model_path: str | os.PathLike[str], model_config: ModelConfig,
                    mtp: bool = False) -> DecoderForCausalLM:
        """The model on the device, its weights from ``model_path`` or, with
        ``load_format="dummy"``, random (``fill_dummy_weights``; the same seed on every rank);
        with ``quantization="fp8"`` its 16-bit linear layers then quantized per channel. ``mtp``:
        with its MTP head (``model/qwen3_5_mtp.py``), whose weights load too."""
        dummy = self.config.load_format == "dummy"
        if not dummy:
            require_weights(model_path)  # before a model is built for weights that are not there
        with _default_dtype(self.dtype), self.device:
            model = build_model(model_config, ops=self.ops, tp_rank=self.tp_rank, tp_size=self.tp_size)
            if mtp:
                attach_mtp(model)  # type: ignore[arg-type]
        if dummy:
            fill_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, model_path)
        if self.config.quantization == "fp8":
            quantize_to_fp8(model)  # a 16-bit checkpoint's layers; an FP8 one's are already
        return model.eval()

    def size_kv_pool_from_free_memory(self, gpu_memory_utilization: float) -> tuple[int, int]:
        """How many KV blocks, and for a hybrid model state snapshots, fit in
        ``gpu_memory_utilization`` of the device: ``(num_blocks, num_snapshots)``.

        Runs a warm-up step at the largest batch (``max_num_batched_tokens``
        tokens, logits and sampling for ``max_num_seqs`` rows) against a
        one-block dummy cache, and counts its peak (weights + activations) as used.
        A hybrid model's states come off the rest first: its slots (and draft states), then
        its snapshots, ``SNAPSHOTS_PER_SEQ`` per sequence but at most
        ``SNAPSHOT_MEMORY_SHARE`` of what the slots leave (a state can weigh as much as
        hundreds of blocks: docs/design.md, "Hybrid models"); the KV blocks take the remainder.

        Raises:
            ValueError: no block fits.

        Off CUDA there is no free-memory figure to go by: the pool holds every
        sequence at full length, at most ``CPU_KV_CACHE_BYTES``, and a hybrid model keeps
        ``SNAPSHOTS_PER_SEQ`` snapshots per sequence (none without the prefix cache).
        """
        layout = self.state_layout
        if self.device.type != "cuda":
            return self._default_cpu_pool(), layout.num_snapshots if layout is not None else 0
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._warm_up()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        others = total - free - torch.cuda.memory_reserved(self.device)  # other processes, context
        budget = total * gpu_memory_utilization - others - peak
        num_snapshots, states = 0, ""
        if layout is not None:
            entry = state_bytes(self.model_config, self.dtype, self.tp_size, hidden=self.use_mtp)
            budget -= (layout.num_entries - layout.num_snapshots) * entry     # slots and draft states
            num_snapshots = max(0, min(layout.num_snapshots, int(budget * SNAPSHOT_MEMORY_SHARE // entry)))
            budget -= num_snapshots * entry
            states = (f", recurrent states {layout.num_slots} slots + {num_snapshots} snapshots: "
                      f"{(layout.num_entries - layout.num_snapshots + num_snapshots) * entry / 2**30:.2f} GiB")
        num_blocks = int(budget // self.block_bytes)
        if num_blocks < 1:
            raise ValueError(f"no KV block fits: {budget / 2**30:.2f} GiB left of "
                             f"{gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB after a "
                             f"warm-up peak of {peak / 2**30:.2f} GiB{states}")
        print(f"[minivllm] KV cache ({str(self.kv_dtype).removeprefix('torch.')}): {num_blocks} blocks x "
              f"{self.block_size} = {num_blocks * self.block_size:,} tokens, "
              f"{num_blocks * self.block_bytes / 2**30:.2f} GiB "
              f"(peak of the warm-up {peak / 2**30:.2f} GiB){states}")
        return num_blocks, num_snapshots

    def _default_cpu_pool(self) -> int:
        """Off CUDA: room for every sequence at full length, capped at CPU_KV_CACHE_BYTES."""
        want = cdiv(self.max_num_seqs * self.max_model_len, self.block_size)
        floor = cdiv(self.max_model_len, self.block_size)  # one full-length sequence always fits
        return max(floor, min(want, CPU_KV_CACHE_BYTES // self.block_bytes))

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """The largest step this executor accepts, over a one-block dummy cache (writes nothing)."""
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
            max_q_len=max(q_lens), is_decode=False, kv_cache=dummy, state=self._dummy_state(num_seqs))
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
            if self.tp_size > 1 and tensors.vocab_parallel_ok:  # the shard path (an (S, 2) all-gather)
                shard = self.model.compute_logits(hidden[:rows], gather=False)
                self.sampler.forward_vocab_parallel(shard, tensors, self.model.lm_head.vocab_start,
                                                    step_seed=0)  # the step counter stays TP=1's
        self._warm_up_extras(hidden, logits)
        del hidden, logits, dummy

    def _dummy_state(self, num_seqs: int) -> StateMetadata | None:
        """A hybrid model's warm-up: zeroed states of its own for ``num_seqs`` fresh rows (None otherwise)."""
        if self.state_layout is None:
            return None
        conv, recurrent = allocate_linear_state(self.model_config, num_seqs, self.dtype, self.device, self.tp_size)
        fresh = torch.zeros(num_seqs, dtype=torch.bool, device=self.device)
        return StateMetadata(slots=torch.arange(num_seqs, device=self.device), has_initial_state=fresh,
                             conv_state=conv, recurrent_state=recurrent)

    def _warm_up_extras(self, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """Penalties on every row under a full sort (a float32 copy of the logits beside the
        sort: the sampler's largest peak), logprobs at the largest K, one slice of prompt logprobs."""
        rows, vocab = logits.shape
        params = [SamplingParams(top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
                                 repetition_penalty=1.2, logprobs=MAX_LOGPROBS)] * rows
        history = TokenHistory(np.arange(32, dtype=np.int64) % vocab, num_prompt_tokens=16)
        host = PenaltyInputs.gather(np.arange(rows), [history] * rows, params, vocab)
        penalties = host.on_device([torch.from_numpy(a).to(self.device) for a in host.arrays()])
        tensors = SamplingTensors.build(params, np.zeros(rows, dtype=np.int64), vocab, self.device)
        tokens = self.sampler(logits, tensors, penalties=penalties)
        sliced_logprobs(lambda s: logits[s], tokens, MAX_LOGPROBS)
        n = min(hidden.shape[0], SLICE_ROWS)
        sliced_logprobs(lambda s: self.model.compute_logits(hidden[s]), tokens.new_zeros(n), MAX_LOGPROBS)

    def num_kv_blocks(self) -> int:
        """The size of the block pool."""
        return self.num_blocks

    def state_pool(self) -> tuple[int, int]:
        """A hybrid model's (state slots, snapshots) (``executor/linear_state.py``); (0, 0) for
        a model without recurrent state."""
        if self.state_layout is None:
            return 0, 0
        return self.state_layout.num_slots, self.state_layout.num_snapshots

    def execute(self, plan: StepPlan) -> StepResult:
        """``submit(plan).result()``."""
        return self.submit(plan).result()

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> StepHandle:
        """Enqueue the step (inputs up, model, sampler, results down) and return without waiting.

        On CUDA nothing here waits for the device: the inputs go up from pinned
        memory, referenced tokens are gathered from ``prev_sampled`` on the
        device, and the results (sampled ids, and log-probabilities where asked)
        come down in one int64 copy into a pinned buffer behind an event that
        ``result()`` waits on. Elsewhere the step runs to completion.

        Raises:
            ValueError: the plan does not fit this executor (see ``prepare``), or
                its penalty histories or prompt-logprob targets do not match its
                sequences (see ``_extras``).
        """
        if self._awaiting_bitmask is not None:
            raise RuntimeError("a plan submitted before the previous step's token bitmask was given "
                               "(its samples, which this plan may feed, are not drawn yet)")
        if plan.num_seqs == 0:
            return DoneStep(StepResult(sampled={}))
        batch, inputs = self.prepare(plan)
        seq_ids = [i for i, s in zip(plan.seq_ids, plan.sample) if s]
        params = [p for p, s in zip(plan.sampling_params, plan.sample) if s]
        extras = self._extras(plan, inputs, batch, seq_ids, params)
        if self.drafter is not None:  # its cache keeps up; drafts made on the device go into the ids
            self.drafter.run(batch, inputs, plan.num_drafts if plan.drafts_on_device else (),
                             lambda *a: self._upload_all(*a, ring=self._draft_staging))
        elif self.mtp_runner is not None:
            self.mtp_runner.draft(plan, batch, inputs, lambda *a: self._upload_all(*a, ring=self._draft_staging))
        elif plan.drafts_on_device:
            raise ValueError("the plan asks for drafts made on the device, but this executor has no draft model")
        hidden = self._forward(batch)                                     # (T, hidden)
        if self.mtp_runner is not None:  # the head's K/V keeps up; the hidden states join the state
            self.mtp_runner.mirror(plan, batch, inputs, hidden, lambda *a: self._upload_all(*a, ring=self._mtp_staging))
            assert self.states is not None and batch.attn_metadata.state is not None
            self.states.save_hidden(hidden, batch.attn_metadata.state, batch.attn_metadata.cu_seqlens_q)
        if plan.num_masked_rows:  # the sampler waits for the masks; the forward runs meanwhile
            step = _MaskedStep(lambda bitmask: self._finish_step(plan, inputs, batch, hidden, seq_ids, params,
                                                                 extras, bitmask), self)
            self._awaiting_bitmask = step
            return step
        return self._finish_step(plan, inputs, batch, hidden, seq_ids, params, extras, None)

    def _finish_step(self, plan: StepPlan, inputs: BatchInputs, batch: DeviceBatch, hidden: torch.Tensor,
                     seq_ids: list[int], params: list[SamplingParams], extras: _Extras,
                     bitmask: np.ndarray | None) -> StepHandle:
        """Sample (under ``bitmask``'s grammar masks, if given), then bring the results down."""
        accepted = None
        if seq_ids:
            scored = bitmask  # with drafts: one row per scored position; the sampler takes each row's last
            if bitmask is not None and len(plan.num_drafts):
                bitmask = bitmask[np.cumsum(1 + plan.num_drafts[plan.sample]) - 1]
            drafted = bool(len(plan.num_drafts))
            if drafted and bool(plan.num_drafts[plan.sample].all()):  # every row's token comes from the scorer
                tokens, logprobs = torch.zeros(len(seq_ids), dtype=torch.int64, device=self.device), None
            else:
                tokens, logprobs = self._sample(plan, inputs, batch, hidden, params, extras, bitmask,
                                                with_logprobs=not drafted)
            if drafted:
                tokens, accepted = self._verify_drafts(plan, inputs, batch, hidden, tokens, scored)
                if self.states is not None:  # slots back to the state after the kept tokens
                    self.states.keep_accepted(plan, accepted,
                                              lambda *a: self._upload_all(*a, ring=self._keep_staging))
                if extras.logprobs is not None:
                    logprobs = self._drafted_logprobs(plan, inputs, batch, hidden, tokens, accepted, extras, scored)
            self.prev_sampled[:len(seq_ids)].copy_(tokens)
            self.prev_sample_row = {sid: row for row, sid in enumerate(seq_ids)}
        else:
            self.prev_sample_row = {}  # the next plan can refer to nothing of this one
            if extras.prompt is None:
                return DoneStep(StepResult(sampled={}))
            tokens, logprobs = torch.empty(0, dtype=torch.int64, device=self.device), None
        prompt = None
        if extras.prompt is not None:
            rows = extras.prompt_rows
            prompt = sliced_logprobs(lambda s: self.model.compute_logits(hidden[rows[s]]),
                                     extras.prompt_targets, extras.prompt.max_k)
        drafted = None if accepted is None else [sid for sid, d in zip(plan.seq_ids, plan.num_drafts) if d]
        made, drafts = None, []
        if accepted is not None and plan.drafts_on_device:  # the drafts, from the ids the target was fed
            rows = np.flatnonzero(plan.num_drafts)
            made = plan.num_drafts[rows].tolist()
            into = np.concatenate([inputs.cu_seqlens_q[r] + 1 + np.arange(d) for r, d in zip(rows, made)])
            drafts = [batch.input_ids[self._upload(into.astype(np.int64))]]
        return self._results(_StepOutputs(seq_ids, extras.logprobs, extras.prompt, drafted, made),
                             [tokens] + ([accepted] if accepted is not None else []) + drafts
                             + [t.packed() for t in (logprobs, prompt) if t is not None])

    def verifies_drafts(self, params: SamplingParams) -> bool:
        """Rows this executor scores with drafts: without shaped logits (greedy rows keep the
        argmax run; random ones are rejection-sampled, ``sampler/rejection.py``)."""
        return not params.shapes_logits

    def _scored(self, plan: StepPlan, inputs: BatchInputs, sel: np.ndarray,
                bitmask: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Where sampling rows ``sel`` (indices among the plan's sampling rows) are scored: their
        drafts d (R,); the token rows scoring positions 0..k (R, k + 1), past a row's d its
        last; where the drafts were fed (R, k; indices into the step's input ids, past d its
        last token's); and each position's ``bitmask`` row (R, k + 1; None without a bitmask:
        one row per scored position, rows in order)."""
        rows = np.flatnonzero(plan.sample)
        d_all = plan.num_drafts[rows].astype(np.int64)
        d = d_all[sel]
        k = int(d.max())
        j = np.minimum(np.arange(k + 1)[None, :], d[:, None])                 # (R, k + 1)
        ends = inputs.cu_seqlens_q[rows[sel] + 1].astype(np.int64)           # one past each row's last token
        at = (ends - 1 - d)[:, None] + j                                    # position 0: the row's last known token
        fed = np.minimum(at[:, :k] + 1, ends[:, None] - 1)
        masks = None
        if bitmask is not None:
            masks = np.concatenate([[0], np.cumsum(1 + d_all)[:-1]])[sel][:, None] + j
        return d, at, fed, masks

    def _drafted_logprobs(self, plan: StepPlan, inputs: BatchInputs, batch: DeviceBatch, hidden: torch.Tensor,
                          tokens: torch.Tensor,
                          accepted: torch.Tensor, extras: _Extras, bitmask: np.ndarray | None) -> LogprobTensors:
        """Logprobs of a drafted step's rows that ask: one per scored position (1 + d rows a
        sequence, ``LogprobLayout.num_rows``), of the kept draft there, or of the row's own
        token at the first position not kept (the rows after it are sent and never read),
        from the raw logits (under the position's mask where masked)."""
        sampling = [p for p, s in zip(plan.sampling_params, plan.sample) if s]
        asking = np.asarray([i for i, p in enumerate(sampling) if p.logprobs is not None], dtype=np.int64)
        d, at, fed, masks = self._scored(plan, inputs, asking, bitmask)
        j = np.arange(at.shape[1])
        keep = j[None, :] <= d[:, None]                                    # (R, k + 1): the positions scored
        owner = np.repeat(asking, 1 + d)                                    # sampling row of each logprob row
        fed = np.concatenate([fed, np.zeros((len(d), 1), dtype=fed.dtype)], axis=1)  # position k: no draft
        owner_t, j_t, at_t, fed_t = (self._upload(a) for a in (owner, np.broadcast_to(j, at.shape)[keep],
                                                               at[keep], fed[keep]))
        fed_t = batch.input_ids[fed_t]
        targets = torch.where(j_t < accepted[owner_t], fed_t, tokens[owner_t])
        mask_rows = None if masks is None else self._upload_bitmask(np.ascontiguousarray(bitmask[masks[keep]]))

        def logits_of(s: slice) -> torch.Tensor:
            logits = self.model.compute_logits(hidden[at_t[s]])
            return logits if mask_rows is None else apply_token_bitmask(logits, mask_rows[s])
        assert extras.logprobs is not None
        return sliced_logprobs(logits_of, targets, extras.logprobs.max_k)

    def _verify_drafts(self, plan: StepPlan, inputs: BatchInputs, batch: DeviceBatch, hidden: torch.Tensor,
                       tokens: torch.Tensor, bitmask: np.ndarray | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify the drafted rows (``rejection.sample_drafted``): p at each of a row's 1 + d
        positions as the sampler would draw from it (under the position's ``bitmask`` row, if
        masked), the token after the kept drafts drawn by the sampler; a greedy row keeps its
        argmax run. Randomness is keyed as the sampler's (a seeded row by its seed and each
        token's position). Returns the sampling rows' tokens (S,) and accepted counts (S,)."""
        d_all = plan.num_drafts[plan.sample].astype(np.int64)
        drafted = np.flatnonzero(d_all)
        d, at, fed, masks = self._scored(plan, inputs, drafted, bitmask)
        r, k1 = at.shape
        at_t, fed_t, d_t, drafted_t = self._upload_all(at.reshape(-1), fed, d, drafted, ring=self._scoring_staging)
        logits = self.model.compute_logits(hidden[at_t])
        if masks is not None:
            logits = apply_token_bitmask(logits, self._upload_bitmask(np.ascontiguousarray(bitmask[masks.reshape(-1)])))
        fed_t = batch.input_ids[fed_t]
        params = [p for p, s in zip(plan.sampling_params, plan.sample) if s]
        if all(params[i].greedy for i in drafted):  # drafts kept while each is the argmax
            best = logits.argmax(-1).view(r, k1)
            valid = torch.arange(k1 - 1, device=self.device)[None, :] < d_t[:, None]
            a = ((fed_t == best[:, :k1 - 1]) & valid).to(torch.int64).cumprod(1).sum(1)
            own = best.gather(1, a[:, None])[:, 0]
            return self._place_drafted(tokens, drafted_t, own, a)
        # Scored position j samples the token at position kv_len - d + j.
        kv = inputs.kv_lens[np.flatnonzero(plan.sample)[drafted]].astype(np.int64)
        positions = (kv - d)[:, None] + np.arange(k1)[None, :]
        t = SamplingTensors.build([params[i] for i in drafted for _ in range(k1)], positions.reshape(-1),
                                  self.model_config.vocab_size, self.device)
        step_seed = self.sampler.next_step_seed()
        keys = row_keys(t.seeded, t.seed_keys, step_seed).view(r, k1, 2)
        accept_u = hashed_uniform((keys[:, :k1 - 1] ^ _ACCEPT_SALT).reshape(-1, 2), 1).view(r, k1 - 1)
        own, a = rejection.sample_drafted(self.sampler, logits.view(r, k1, -1), t, fed_t, d_t, accept_u, step_seed)
        return self._place_drafted(tokens, drafted_t, own, a)

    @staticmethod
    def _place_drafted(tokens: torch.Tensor, drafted: torch.Tensor, own: torch.Tensor,
                       accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampling rows' tokens (S,) with the drafted rows' ``own`` in place, and their
        accepted counts (S,; 0 on rows without drafts)."""
        tokens = tokens.clone()
        tokens[drafted] = own
        out = torch.zeros_like(tokens)
        out[drafted] = accepted
        return tokens, out

    def _upload(self, a: np.ndarray) -> torch.Tensor:
        """A small host array on the device without waiting for the stream (a pageable copy
        would wait for the forward before it): pinned, then copied asynchronously."""
        t = torch.from_numpy(np.ascontiguousarray(a))
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _sample(self, plan: StepPlan, inputs: BatchInputs, batch: DeviceBatch, hidden: torch.Tensor,
                params: list[SamplingParams], extras: _Extras, bitmask: np.ndarray | None = None,
                with_logprobs: bool = True) -> tuple[torch.Tensor, LogprobTensors | None]:
        """Sample the plan's sampling rows: token ids (S,) on the device, and their logprobs where
        asked; ``bitmask`` (int32 (S, W)) masks the raw logits first, so logprobs are those of
        the constrained distribution, as in vLLM."""
        # A sampled token's position is its sequence's length so far: the seeded-row counter.
        tensors = SamplingTensors.build(params, inputs.kv_lens[plan.sample], self.model_config.vocab_size,
                                        self.device)
        biased = any(map(_SHAPES_LOGITS, params))
        if bitmask is None and not biased and self._samples_from_shards(tensors, extras):
            shard = self.model.compute_logits(hidden[batch.sample_indices], gather=False)  # (S, V / tp)
            return self.sampler.forward_vocab_parallel(shard, tensors, self.model.lm_head.vocab_start), None
        logits = self.model.compute_logits(hidden[batch.sample_indices])  # (S, V), raw
        if bitmask is not None:
            logits = apply_token_bitmask(logits, self._upload_bitmask(bitmask))
        # The bias shapes the sampling, not the logprobs (raw, as vLLM's default).
        sampled_from = apply_logit_bias(logits, params) if biased else logits
        tokens = self.sampler(sampled_from, tensors, penalties=extras.penalties)  # (S,) int64 on the device
        if extras.logprobs is None or not with_logprobs:
            return tokens, None
        rows = extras.logprob_rows  # None: every row asks
        if rows is None:
            return tokens, sliced_logprobs(lambda s: logits[s], tokens, extras.logprobs.max_k)
        return tokens, sliced_logprobs(lambda s: logits[rows[s]], tokens[rows], extras.logprobs.max_k)

    def _samples_from_shards(self, tensors: SamplingTensors, extras: _Extras) -> bool:
        """Under tensor parallelism, whether this step's rows can be sampled from the vocab
        shards (no gather of the (S, V) logits): no penalty, filter or logprobs needs whole
        rows. Decided from the plan alone, so every rank takes the same collectives."""
        return self.tp_size > 1 and tensors.vocab_parallel_ok and extras.penalties is None and extras.logprobs is None

    def _results(self, outputs: _StepOutputs, blocks: list[torch.Tensor]) -> StepHandle:
        """Bring the int64 ``blocks`` (sampled ids, packed logprobs) down in one copy."""
        packed = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        if self.device.type != "cuda":
            return DoneStep(outputs.unpack(packed.numpy()))
        host = self._outputs.next(packed.shape[0])
        host.copy_(packed, non_blocking=True)
        return _CudaStep(outputs, host, self._outputs.record())

    def _extras(self, plan: StepPlan, inputs: BatchInputs, batch: DeviceBatch, seq_ids: list[int],
                params: list[SamplingParams]) -> _Extras:
        """The step's penalties, logprob rows and prompt-logprob targets, sent up in one copy.

        When no row asks for any of them this costs one pass over ``params``.

        Raises:
            ValueError: see ``_gather_penalties`` and ``_gather_prompt_targets``.
        """
        penalties = self._gather_penalties(plan, params)
        logprobs, lp_rows = _gather_logprob_rows(
            seq_ids, params, 1 + plan.num_drafts[plan.sample] if len(plan.num_drafts) else None)
        prompt = self._gather_prompt_targets(plan, inputs)
        arrays: list[np.ndarray] = []
        if penalties is not None:
            arrays += penalties.arrays()
        if lp_rows is not None:
            arrays.append(lp_rows)
        if prompt is not None:
            arrays += prompt[1:]
        up = iter(self._upload_all(*arrays, ring=self._extras_staging) if arrays else ())
        pen = None
        if penalties is not None:
            referenced = referenced_tokens(batch, self.prev_sampled)  # before this step overwrites it
            pen = penalties.on_device([next(up), next(up), next(up)], referenced)
        lp_dev = next(up) if lp_rows is not None else None
        prompt_rows, prompt_targets = (next(up), next(up)) if prompt is not None else (None, None)
        return _Extras(penalties=pen, logprobs=logprobs, logprob_rows=lp_dev,
                       prompt=prompt[0] if prompt is not None else None,
                       prompt_rows=prompt_rows, prompt_targets=prompt_targets)

    def _gather_penalties(self, plan: StepPlan, params: list[SamplingParams]) -> PenaltyInputs | None:
        """The histories of the sampling rows with penalties (None without; free when the plan has none).

        Raises:
            ValueError: the plan's histories are not exactly those of its sampling
                sequences whose params have penalties.
        """
        if not plan.histories:
            return None
        if len(plan.histories) != plan.num_seqs:
            raise ValueError(f"plan has {len(plan.histories)} histories for {plan.num_seqs} sequences")
        sample_rows = np.flatnonzero(plan.sample)
        penalised = [i for i, p in enumerate(params) if p.has_penalties]  # sampling rows
        wanted = sample_rows[penalised].tolist()                           # plan rows
        given = [r for r, h in enumerate(plan.histories) if h is not None]
        if given != wanted:
            ids = np.asarray(plan.seq_ids)
            raise ValueError(f"plan carries histories for sequences {ids[given].tolist()}, but its "
                             f"sampling sequences with penalties are {ids[wanted].tolist()}")
        return PenaltyInputs.gather(penalised, [plan.histories[r] for r in wanted],
                                    [params[i] for i in penalised], self.model_config.vocab_size)

    def _gather_prompt_targets(self, plan: StepPlan, inputs: BatchInputs
                               ) -> tuple[LogprobLayout, np.ndarray, np.ndarray] | None:
        """Layout, token rows (N,) and target ids (N,) of the plan's prompt-logprob targets (None: none).

        Raises:
            ValueError: targets for a sequence whose params ask for no prompt
                logprobs, not 1-D, more than its chunk feeds, none, or out of the vocab.
        """
        targets = plan.prompt_logprob_targets
        if not targets:
            return None
        if len(targets) != plan.num_seqs:
            raise ValueError(f"plan has {len(targets)} prompt-logprob targets for {plan.num_seqs} sequences")
        seqs = [r for r, t in enumerate(targets) if t is not None]
        ks = [plan.sampling_params[r].prompt_logprobs for r in seqs]
        lens = np.array([targets[r].size for r in seqs], dtype=np.int64)
        bad = [plan.seq_ids[r] for r, k, n in zip(seqs, ks, lens)
               if k is None or targets[r].ndim != 1 or not 1 <= n <= plan.query_lens[r]]
        if bad:
            raise ValueError(f"prompt-logprob targets of sequence(s) {bad} are not 1 to query_len ids "
                             "of a sequence whose params ask for prompt_logprobs")
        flat = np.concatenate([targets[r] for r in seqs]).astype(np.int64)
        vocab = self.model_config.vocab_size
        if flat.min() < 0 or flat.max() >= vocab:
            raise ValueError(f"a prompt-logprob target is outside [0, {vocab})")
        # Sequence r's i-th target is at token row cu_seqlens_q[r] + i.
        starts = np.cumsum(lens) - lens
        rows = np.arange(flat.size, dtype=np.int64) + np.repeat(inputs.cu_seqlens_q[seqs] - starts, lens)
        layout = LogprobLayout(tuple(plan.seq_ids[r] for r in seqs), tuple(lens.tolist()), tuple(ks))
        return layout, rows, flat

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
        """Batches of one token per sequence that a captured graph covers replay it; the
        others that ``prepare`` gave a tile map replay their token bucket's graph; the rest
        run eagerly."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        if batch.attn_metadata.tile_map is not None:  # prepared for the prefill runner
            return self.prefill_graph_runner.run(batch)  # type: ignore[union-attr]
        ids = resolve_input_ids(batch.input_ids, batch.prev_rows, self.prev_sampled)
        return self.model(ids, batch.positions, batch.attn_metadata)

    def prepare(self, plan: StepPlan) -> tuple[DeviceBatch, BatchInputs]:
        """Compute the plan's index arrays on the host and move them to the device; for a
        hybrid model also copy the snapshots the plan restores into their slots (the
        forward that follows reads them).

        Raises:
            ValueError: the plan exceeds the batch limits, has another block
                size, names a block outside the pool, feeds a sequence a
                previous-step token that the previous step did not sample, or its
                state fields do not fit the model (``StateInputs.from_plan``,
                ``check_no_state_fields``).
        """
        self._check_plan(plan)
        inputs = prepare_inputs(plan)
        if inputs.block_tables.size and int(inputs.block_tables.max()) >= self.num_blocks:
            raise ValueError(f"a block table names block {int(inputs.block_tables.max())}, "
                             f"but the pool has {self.num_blocks} blocks")
        arrays = [inputs.input_ids, self._prev_rows(plan), inputs.positions, inputs.slot_mapping,
                  inputs.sample_indices, inputs.cu_seqlens_q, inputs.kv_lens, inputs.block_tables]
        state_inputs = None
        if self.state_layout is not None:
            state_inputs = StateInputs.from_plan(plan, self.state_layout)
        else:
            check_no_state_fields(plan)
        runner = self.prefill_graph_runner
        bucket = None if runner is None else runner.bucket_for(
            plan.num_tokens, plan.num_seqs, inputs.block_tables.shape[1], plan.one_token_per_seq,
            0 if state_inputs is None else state_inputs.save_rows.size)
        if bucket is not None:  # runner is not None
            arrays.append(runner.tile_map_for(inputs.cu_seqlens_q, bucket))  # type: ignore[union-attr]
        num_step_arrays = len(arrays)
        if state_inputs is not None:
            arrays += state_inputs.arrays()
        uploaded = self._upload_all(*arrays)
        ids, prev_rows, pos, slots, sample, cu_q, kv_lens, tables, *tile_map = uploaded[:num_step_arrays]
        meta = AttentionMetadata(
            slot_mapping=slots, cu_seqlens_q=cu_q.to(torch.int32), kv_lens=kv_lens.to(torch.int32),
            block_tables=tables.to(torch.int32), max_q_len=inputs.max_q_len,
            is_decode=plan.one_token_per_seq, kv_cache=self.kv_cache,
            tile_map=tile_map[0].to(torch.int32) if tile_map else None,
            state=self.states.metadata(uploaded[num_step_arrays:]) if self.states is not None else None)
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

    def _upload_bitmask(self, bitmask: np.ndarray) -> torch.Tensor:
        """The int32 token bitmask on the device (on CUDA through a pinned ring of its own)."""
        if self.device.type != "cuda":
            return torch.from_numpy(bitmask)
        n = bitmask.size
        staging = self._mask_staging.next((n + 1) // 2).view(torch.int32)[:n]
        staging.numpy()[:] = bitmask.reshape(-1)
        on_device = staging.to(self.device, non_blocking=True)
        self._mask_staging.record()
        return on_device.view(bitmask.shape)

    def _upload_all(self, *arrays: np.ndarray, ring: _PinnedRing | None = None) -> list[torch.Tensor]:
        """Host arrays -> int64 device tensors of the same shapes, in ONE copy.

        On CUDA the arrays are packed into a pinned buffer of ``ring`` (default: the
        step inputs' ring of two, so the host never rewrites one the previous step's
        copy may still read; one upload a step per ring) and sent with a single
        non-blocking copy.
        """
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self.device.type == "cpu":
            flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]).astype(np.int64))
        else:
            ring = ring or self._staging
            staging = ring.next(total)
            np.concatenate([a.reshape(-1) for a in arrays], out=staging.numpy(), casting="unsafe")
            flat = staging.to(self.device, non_blocking=True)
            ring.record()
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


def _first_attention(model: DecoderForCausalLM) -> torch.nn.Module:
    """The first full-attention layer's attention (a hybrid model's first ``self_attn``): the
    KV cache's heads per rank."""
    for layer in model.model.layers:
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            return attn
    raise ValueError(f"{model.config.architecture}: no full-attention layer to hold a KV cache for")


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
