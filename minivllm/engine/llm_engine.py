"""The engine loop: requests in, a plan per step to the executor, outputs back.

Pure Python + numpy; the executor behind ``Executor`` does the model work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

import numpy as np

from minivllm.config import CacheConfig, SchedulerConfig, cdiv
from minivllm.engine.block_manager import InvariantError
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.engine.scheduler import Scheduler, SchedulerOutput
from minivllm.engine.sequence import Sequence, SequenceStatus
from minivllm.executor.base import Executor
from minivllm.outputs import FinishReason, RequestOutput
from minivllm.sampling import SamplingParams

__all__ = ["LLMEngine", "EngineStats", "StepRecord", "InvariantError"]


@dataclass
class EngineStats:
    """Running counters over the engine's life."""

    num_steps: int = 0
    num_prefill_tokens: int = 0   # tokens computed other than single decode tokens
    num_decode_tokens: int = 0    # one per sequence per decode step
    num_cached_tokens: int = 0    # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    num_chunked_prefills: int = 0  # scheduled sequences that got a partial chunk
    num_aborts: int = 0


@dataclass(frozen=True)
class StepRecord:
    """What the last ``step()`` decided (for traces, replay and invariants)."""

    scheduled: dict[str, int]                 # request id -> tokens computed
    preempted: tuple[str, ...]
    finished: dict[str, tuple[int, ...]] = field(default_factory=dict)
    num_free_blocks: int = 0


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    Args:
        scheduler_config: batching limits and policy.
        cache_config: block size, pool size (None: ask the executor), prefix caching.
        executor: computes the planned tokens (fake numpy model or real model).
        eos_token_id: ends a request (unless its params say ``ignore_eos``).

    Raises:
        ValueError: the configured pool is larger than the executor holds.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 executor: Executor, eos_token_id: int | None = None) -> None:
        available = executor.num_kv_blocks()
        num_blocks = cache_config.num_blocks if cache_config.num_blocks is not None else available
        if num_blocks > available:
            raise ValueError(f"num_blocks={num_blocks} but the executor holds only {available} blocks")
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.executor = executor
        self.eos_token_id = eos_token_id
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(scheduler_config, cache_config, num_blocks)
        self.requests: dict[str, Sequence] = {}   # unfinished requests by id
        self._finished_ids: set[str] = set()
        self._pending_outputs: list[RequestOutput] = []  # aborts, returned by the next step()
        self._next_seq_id = 0
        self.stats = EngineStats()
        self.last_step: StepRecord | None = None
        self._last_out: SchedulerOutput | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.scheduler.block_manager.num_free_blocks

    # ---- requests -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int],
                    sampling_params: SamplingParams | None = None) -> None:
        """Queue a request; raises ``ValueError``/``TypeError`` (nothing queued) if it can never run."""
        params = SamplingParams() if sampling_params is None else sampling_params
        self._validate_request(request_id, prompt_token_ids, params)
        seq = Sequence(self._next_seq_id, request_id, [int(t) for t in prompt_token_ids], params)
        self._next_seq_id += 1
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def _validate_request(self, request_id: str, prompt: Seq[int], params: SamplingParams) -> None:
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests or request_id in self._finished_ids:
            raise ValueError(f"request {request_id!r}: duplicate request id")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"request {request_id!r}: sampling_params must be SamplingParams")
        if len(prompt) == 0:
            raise ValueError(f"request {request_id!r}: prompt is empty")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0:
            raise ValueError(f"request {request_id!r}: prompt token ids must be a flat list of ints >= 0")
        max_len = self.scheduler_config.max_model_len
        if len(prompt) + params.max_tokens > max_len:
            raise ValueError(f"request {request_id!r}: prompt ({len(prompt)} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds max_model_len ({max_len})")
        # The last sampled token is never fed back, so at most this many are computed.
        need = cdiv(len(prompt) + params.max_tokens - 1, self.cache_config.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request {request_id!r}: needs up to {need} KV blocks but the "
                             f"whole pool has {self.num_blocks}")

    def abort_request(self, request_id: str) -> bool:
        """Abort a waiting or running request; its output (``abort``) comes with the next ``step()``.

        Returns:
            True if aborted, False if the request had already finished.
        Raises:
            ValueError: no request with this id was ever added.
        """
        seq = self.requests.pop(request_id, None)
        if seq is None:
            if request_id in self._finished_ids:
                return False
            raise ValueError(f"abort_request: unknown request id {request_id!r}")
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        self._finished_ids.add(request_id)
        self._pending_outputs.append(self._output(seq))
        self.stats.num_aborts += 1
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    # ---- the step -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, execute and apply one step; returns requests finished since the last step.

        Raises:
            RuntimeError: nothing could be scheduled or preempted although requests
                are unfinished (a bug: admission checks should make this impossible),
                or the executor's result does not match the plan.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        out = self.scheduler.schedule()
        self._last_out = out
        if not out.scheduled:
            if self.scheduler.has_unfinished() and not out.preempted:
                bm = self.scheduler.block_manager
                raise RuntimeError(
                    f"scheduler made no progress: {len(self.scheduler.waiting)} waiting, "
                    f"{len(self.scheduler.running)} running, {bm.num_free_blocks} of "
                    f"{bm.num_blocks} blocks free")
            self._record(out, outputs)
            return outputs
        plan = self._build_plan(out)
        result = self.executor.execute(plan)
        self._check_result(plan, result)
        outputs.extend(self._apply(out, result))
        self._record(out, outputs)
        return outputs

    def _build_plan(self, out: SchedulerOutput) -> StepPlan:
        seqs = [s for s, _ in out.scheduled]
        starts = [s.num_computed_tokens for s in seqs]
        chunks = [s.token_ids[c:c + n] for (s, n), c in zip(out.scheduled, starts)]
        return StepPlan.build(
            seq_ids=[s.seq_id for s in seqs],
            token_chunks=chunks,
            start_positions=starts,
            block_tables=[tuple(s.block_table) for s in seqs],
            sample=[c + n == s.num_tokens for (s, n), c in zip(out.scheduled, starts)],
            sampling_params=[s.sampling_params for s in seqs],
            block_size=self.cache_config.block_size,
        )

    @staticmethod
    def _check_result(plan: StepPlan, result: StepResult) -> None:
        expected = {sid for sid, smp in zip(plan.seq_ids, plan.sample) if smp}
        if set(result.sampled) != expected:
            raise RuntimeError(f"executor sampled for sequences {sorted(result.sampled)}, "
                               f"the plan asked for {sorted(expected)}")

    def _apply(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Advance computed tokens, cache full blocks, append samples, finish requests."""
        bm = self.scheduler.block_manager
        finished = []
        for seq, n in out.scheduled:
            decode = n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
            if decode:
                self.stats.num_decode_tokens += 1
            else:
                self.stats.num_prefill_tokens += n
            seq.num_computed_tokens += n
            bm.register_computed_blocks(seq)
            token = result.sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.token_ids.append(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
                self._finished_ids.add(seq.request_id)
                finished.append(self._output(seq))
        return finished

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.sampling_params
        if (token == self.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.scheduler_config.max_model_len:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence) -> RequestOutput:
        assert seq.finish_reason is not None
        return RequestOutput(seq.request_id, tuple(seq.token_ids[:seq.num_prompt_tokens]),
                             seq.output_token_ids, seq.finish_reason)

    def _record(self, out: SchedulerOutput, outputs: list[RequestOutput]) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_preemptions += len(out.preempted)
        s.num_chunked_prefills += out.num_chunked
        s.num_cached_tokens += out.num_cached_tokens
        self.last_step = StepRecord(
            scheduled={seq.request_id: n for seq, n in out.scheduled},
            preempted=tuple(seq.request_id for seq in out.preempted),
            finished={o.request_id: o.token_ids for o in outputs},
            num_free_blocks=self.num_free_blocks,
        )

    # ---- invariants ---------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if any invariant of DESIGN.md does not hold."""
        sched, cfg = self.scheduler, self.scheduler_config
        waiting, running = sched.waiting, sched.running
        queued = {s.request_id for s in waiting} | {s.request_id for s in running}
        if len(queued) != len(waiting) + len(running):
            raise InvariantError("a request is queued twice")
        if queued != self.requests.keys():
            raise InvariantError(f"queues {sorted(queued)} differ from unfinished {sorted(self.requests)}")
        for s in waiting:
            if s.status is not SequenceStatus.WAITING or s.block_table or s.num_computed_tokens:
                raise InvariantError(f"{s}: a waiting (or preempted) sequence is not bare")
        for s in running:
            if s.status is not SequenceStatus.RUNNING or s.num_uncomputed_tokens < 1:
                raise InvariantError(f"{s}: running but not RUNNING, or nothing left to compute")
        if len(running) > cfg.max_num_seqs:
            raise InvariantError(f"{len(running)} running > max_num_seqs {cfg.max_num_seqs}")
        sched.block_manager.check_invariants(running)
        self._check_last_step()
        bm = sched.block_manager
        if not self.requests and (bm.num_free_blocks != bm.num_blocks or any(bm.ref_counts)):
            raise InvariantError("engine idle but blocks are still held")

    def _check_last_step(self) -> None:
        out, cfg = self._last_out, self.scheduler_config
        if out is None:
            return
        if out.num_tokens > cfg.max_num_batched_tokens:
            raise InvariantError(f"step scheduled {out.num_tokens} tokens > budget {cfg.max_num_batched_tokens}")
        if len(out.scheduled) > cfg.max_num_seqs:
            raise InvariantError("step scheduled more than max_num_seqs sequences")
        if any(n < 1 for _, n in out.scheduled):
            raise InvariantError("a scheduled sequence got 0 tokens")
        if any(s.status is SequenceStatus.WAITING and s.block_table for s in out.preempted):
            raise InvariantError("a preempted sequence still holds blocks")
