"""Tensor parallelism: one process per rank, the engine once, in the driver (rank 0).

    driver process (rank 0)                      worker process r = 1 .. N-1 (spawned)
    LLMEngine --plan--> TPExecutor.submit        loop:
        plans.send(plan)  ----- pipe ----->          plan = pipe.recv()      (None: stop)
        ModelExecutor(rank 0).submit(plan)           ModelExecutor(rank r).submit(plan)
            ... all-reduces inside the model (gloo on the CPU, NCCL on GPUs) ...
        <-- StepResult (rank 0's samples)

Each rank holds its shard of every weight (loaded through the parameters'
``weight_loader``) and of the KV cache (its KV heads). The LM head all-gathers
the logits, so every rank holds the whole (S, V) logits and runs the same
sampler with the same seed and call count: every rank samples the same tokens.
It has to: a rank's next step gathers its input ids from its own samples, and a
rank that sampled another token would embed another token, corrupting the
all-reduced hidden states of every rank. So TP=N producing TP=1's tokens
(tests/tp/test_engine_tp.py) also shows that the ranks agree.

The plan (plain data) is pickled once per step and written to one pipe per
worker (``PlanPipes``); nothing else is exchanged outside the model's own
collectives. A pipe, not a gloo ``broadcast_object_list``: it costs the driver a
fraction of the broadcast's host time (docs/tuning.md, "Tensor parallelism"), and a
pipe reports a peer's death itself (EOF, broken pipe).

Start-up: the driver serves the rendezvous ``TCPStore`` (on a port the OS picks)
before it spawns the workers, and each worker checks in on it before joining the
process group; until all have, the driver watches the workers, so one that dies
first (a script without a main guard: spawn re-imports it) is an error at once,
not a wait for the group's timeout.

Failure: a worker that raises puts its traceback on a queue and exits; the
driver checks the queue and the workers' liveness before every step and after
every result, and a collective that fails because a peer went away is re-raised
with the worker's own error. A gloo collective fails at once when a peer leaves;
an NCCL one would wait for its timeout, so on GPUs a watchdog thread in the
driver waits on the workers' process sentinels and aborts the NCCL communicators
when one dies, which releases a driver blocked in a collective within seconds.
A symmetric-memory kernel (``ops/communicator.py``) whose peer died is released
by nothing: rank 0 then polls its step instead of waiting on it, and ``close``
leaves that stream and the group alone (a synchronise or an abort would hang;
seen on two H200s), ends the workers and says the process must restart.

Shutdown (``close``, the ``LLM`` context manager, interpreter exit) sends
``None`` to a healthy group, and then every rank leaves the process group at the
same time (gloo destroys it; NCCL communicators are aborted, see
``_leave_group``). After an error or an interrupt the group is aborted and the
workers are terminated. Workers ignore SIGINT: Ctrl-C reaches the driver, which
ends them.

Testing hook: ``TPExecutor(..., fault=(RANK, "load"))`` or ``(RANK, "stepK")`` makes
worker RANK raise at load or at its K-th step (tests/tp/test_engine_tp.py passes it).
"""

from __future__ import annotations

import atexit
import datetime
import fcntl
import os
import pickle
import queue
import signal
import socket
import threading
import time
import traceback
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_sentinels

from minivllm.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.envs import TP_TIMEOUT_S, tp_timeout_s
from minivllm.executor.base import StepHandle, freeze_imported_objects
from minivllm.executor.model_executor import ModelExecutor
from minivllm.sampling import SamplingParams

JOIN_TIMEOUT_S = 10.0
JOIN_POLL_S = 0.02  # how often the driver looks for workers' check-ins at start-up
DRAIN_WAIT_S = 2.0  # after a failure, how long close() lets rank 0's queued GPU work finish
WEDGED_NOTE = ("rank 0's GPU stream is left waiting in a symmetric-memory all-reduce for the dead "
               "rank; no abort releases it, so this process cannot use that GPU again: restart it")
# How often rank 0 checks its workers while it waits for a step that a one-shot
# all-reduce may have stalled (a step takes milliseconds; this adds at most this much).
POLL_S = 50e-6


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it; never hard-coded)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PlanPipes:
    """One one-way pipe per worker; ``send`` pickles a plan once and writes it to each.

    A worker that died makes ``send`` raise ``BrokenPipeError``; a driver that died
    makes the worker's ``recv_bytes`` raise ``EOFError``.
    """

    PIPE_BYTES = 1 << 20  # a batch-256 plan is ~90 KB: the write returns before the worker reads

    def __init__(self, ctx: Any, n: int) -> None:
        pairs = [ctx.Pipe(duplex=False) for _ in range(n)]
        self.readers = [r for r, _ in pairs]
        self.writers = [w for _, w in pairs]
        for w in self.writers:
            try:  # Linux: a larger pipe buffer (capped by /proc/sys/fs/pipe-max-size)
                fcntl.fcntl(w.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), self.PIPE_BYTES)
            except OSError:
                pass

    def close_readers(self) -> None:
        for r in self.readers:
            r.close()

    def send(self, plan: StepPlan | None) -> None:
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for w in self.writers:
            w.send_bytes(data)

    def close(self) -> None:
        for w in self.writers:
            w.close()


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its executor: plain, picklable data."""

    model_config: ModelConfig
    model_path: str
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    executor_config: ExecutorConfig
    master_addr: str
    master_port: int
    timeout_s: float
    fault: tuple[int, str] | None = None  # testing hook: (rank, "load" | "stepK")
    speculative_config: SpeculativeConfig | None = None  # a draft model is sharded as the target

    @property
    def world_size(self) -> int:
        return self.executor_config.tensor_parallel_size


def _rank_device(device: str, rank: int) -> str:
    """Rank r's device: ``cuda`` means ``cuda:r``; the CPU is shared."""
    return f"cuda:{rank}" if device == "cuda" else device


def _serve_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a port the OS picks (it exists before the spec)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _connect_store(spec: RankSpec) -> dist.TCPStore:
    """A worker's connection to rank 0's store."""
    return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, is_master=False,
                         timeout=datetime.timedelta(seconds=spec.timeout_s))


def _joined_key(rank: int) -> str:
    return f"minivllm/joined/{rank}"


def _init_group(spec: RankSpec, rank: int, store: dist.TCPStore) -> dist.ProcessGroup:
    """Join the process group; returns a CPU (gloo) group (start-up agreement on the KV pool).
    A worker first checks in on the store, so the driver can tell a worker that never
    comes from a slow one (``TPExecutor._wait_for_workers``)."""
    cuda = spec.executor_config.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
    if rank:
        store.set(_joined_key(rank), "1")
    dist.init_process_group(backend="nccl" if cuda else "gloo", store=store, world_size=spec.world_size,
                            rank=rank, timeout=datetime.timedelta(seconds=spec.timeout_s))
    return dist.new_group(backend="gloo") if cuda else dist.group.WORLD


def _min_over_ranks(group: dist.ProcessGroup) -> Callable[[int], int]:
    def agree(n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())
    return agree


def _build_executor(spec: RankSpec, rank: int, group: dist.ProcessGroup) -> ModelExecutor:
    config = replace(spec.executor_config, device=_rank_device(spec.executor_config.device, rank))
    return ModelExecutor(spec.model_config, spec.model_path, spec.scheduler_config, spec.cache_config,
                         config, tp_rank=rank, agree_num_blocks=_min_over_ranks(group),
                         speculative_config=spec.speculative_config)


def _worker_main(rank: int, spec: RankSpec, errors: Any, plans: Connection) -> None:
    """A worker rank: build its shard, then run every broadcast plan until ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    fault = spec.fault[1] if spec.fault is not None and spec.fault[0] == rank else None
    try:
        freeze_imported_objects()
        group = _init_group(spec, rank, _connect_store(spec))
        if fault == "load":
            raise RuntimeError("injected fault at load (TPExecutor fault)")
        executor = _build_executor(spec, rank, group)
        step = 0
        while True:
            try:
                plan: StepPlan | None = pickle.loads(plans.recv_bytes())
            except EOFError:  # the driver is gone: nobody to report to
                os._exit(1)
            if plan is None:
                break
            step += 1
            if fault == f"step{step}":
                raise RuntimeError(f"injected fault at step {step} (TPExecutor fault)")
            executor.submit(plan)  # its samples stay on its device: its next inputs
        executor.close()  # graphs (they hold captured collectives) and buffers, before the group is left
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()  # the message is in the pipe before this process ends
        os._exit(1)  # no teardown collective: the driver sees this rank leave
    _leave_group()


class TPExecutor:
    """The ``Executor`` of ``tensor_parallel_size`` ranks: rank 0 here, the rest in workers.

    Args:
        model_config, model_path, scheduler_config, cache_config, config: as for
            ``ModelExecutor``; ``config.tensor_parallel_size`` ranks are started.
        fault: testing hook, ``(rank, "load")`` or ``(rank, "stepK")``: that worker raises
            at load or at its K-th step.

    Raises:
        ValueError: the model cannot be split that many ways, too few GPUs, or no weights
            (``load_format="auto"``).
        RuntimeError: a worker failed while starting (its traceback included).
    """

    def __init__(self, model_config: ModelConfig, model_path: str, scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, config: ExecutorConfig,
                 fault: tuple[int, str] | None = None, speculative_config: SpeculativeConfig | None = None) -> None:
        from minivllm.layers.weights import check_tp_divisibility
        from minivllm.model.loader import require_weights

        tp = config.tensor_parallel_size
        check_tp_divisibility(model_config, tp)
        if config.device.startswith("cuda") and torch.cuda.device_count() < tp:
            raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs, "
                             f"{torch.cuda.device_count()} visible")
        if config.device not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallelism runs on device 'cpu' or 'cuda' (rank r on cuda:r), "
                             f"got {config.device!r}")
        if config.load_format == "auto":
            require_weights(model_path)  # here, as a ValueError, rather than from every worker
        self._all_reduce_note = ""
        if config.device.startswith("cuda") and not config.disable_custom_all_reduce and _symm_mem_used:
            config = replace(config, disable_custom_all_reduce=True)  # every rank must agree: tell them all
            self._all_reduce_note = " (symmetric memory is set up once per process)"
        timeout_s = tp_timeout_s()
        # Served here before any worker starts, on a port the OS picked (never hard-coded,
        # and no window between choosing a free port and binding it).
        self._store = _serve_store(tp, timeout_s)
        self.spec = RankSpec(model_config, str(model_path), scheduler_config, cache_config, config,
                             "127.0.0.1", self._store.port, timeout_s, fault, speculative_config)
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        self.plans = PlanPipes(ctx, tp - 1)
        self.workers = [ctx.Process(target=_worker_main, args=(r, self.spec, self._errors, self.plans.readers[r - 1]),
                                    daemon=True, name=f"minivllm-tp-rank{r}") for r in range(1, tp)]
        self._healthy = False
        self._closed = False
        self._wedged = False  # rank 0's stream waits in an all-reduce for a dead peer
        for p in self.workers:
            p.start()
        self.plans.close_readers()  # the workers hold them now: a dead worker is a broken pipe
        atexit.register(_close_at_exit, weakref.ref(self))
        try:
            self._wait_for_workers()
            self.group = _init_group(self.spec, 0, self._store)
            self.local = _build_executor(self.spec, 0, self.group)
            _note_symm_mem(self._symm_mem)
        except BaseException as e:
            self._closed = True
            _leave_group()
            self._terminate()
            self._raise_worker_error(e)
            raise
        self._healthy = True
        if config.device.startswith("cuda"):
            threading.Thread(target=self._watch_workers, name="minivllm-tp-watchdog", daemon=True).start()

    # ---- the Executor protocol ----------------------------------------------

    def num_kv_blocks(self) -> int:
        """The pool every rank holds (the minimum over ranks)."""
        return self.local.num_kv_blocks()

    def state_pool(self) -> tuple[int, int]:
        """The recurrent states every rank holds (rank 0's: the ranks size them alike)."""
        return self.local.state_pool()

    def verifies_drafts(self, params: SamplingParams) -> bool:
        """As one rank's executor: every rank scores the same drafts over the gathered logits."""
        return self.local.verifies_drafts(params)

    def submit(self, plan: StepPlan) -> StepHandle:
        """Send the plan to every worker, then run rank 0's shard of it."""
        self._check_workers()
        try:
            self.plans.send(plan)
            return _CheckedHandle(self.local.submit(plan), self)
        except BaseException as e:
            self._healthy = False
            self._raise_worker_error(e)      # a worker that raised said why
            self._raise_if_worker_exited(e)  # one that was killed did not (not "Broken pipe")
            raise

    def execute(self, plan: StepPlan) -> StepResult:
        """``submit(plan).result()``."""
        return self.submit(plan).result()

    @property
    def _symm_mem(self) -> bool:
        """Whether rank 0's all-reduces run on symmetric memory (a dead peer then leaves its
        kernel spinning: nothing aborts it)."""
        local = getattr(self, "local", None)
        comm = local.ops.comm if local is not None else None
        return comm is not None and comm.symm is not None  # None again once closed

    @property
    def graph_runner(self) -> Any:
        """Rank 0's CUDA-graph runner (every rank captures its own)."""
        return self.local.graph_runner

    # ---- failure and shutdown -----------------------------------------------

    @property
    def all_reduce_path(self) -> str:
        """How rank 0's all-reduces travel (``ModelExecutor.all_reduce_path``)."""
        return self.local.all_reduce_path + self._all_reduce_note

    @property
    def captures_prefill_graphs(self) -> bool:
        """As ``ModelExecutor.captures_prefill_graphs`` (every rank does as rank 0)."""
        return self.local.captures_prefill_graphs

    def _wait_for_workers(self) -> None:
        """Return once every worker has checked in on the store. A worker that exits first
        (or reports an error) is a ``RuntimeError`` at once, where ``init_process_group``
        would wait for the whole timeout; so is the timeout itself."""
        keys = [_joined_key(r) for r in range(1, self.spec.world_size)]
        deadline = time.monotonic() + self.spec.timeout_s
        while not self._store.check(keys):
            self._raise_worker_error(None)
            dead = next((p for p in self.workers if p.exitcode is not None), None)
            if dead is not None:
                raise RuntimeError(
                    f"tensor-parallel worker {dead.name} exited (code {dead.exitcode}) before joining the "
                    "process group. Workers are spawned and import the main module first: a script "
                    "that builds the LLM at import time must do it under `if __name__ == \"__main__\":` "
                    "(the worker's own traceback is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not join within {self.spec.timeout_s:.0f} s "
                                   f"(${TP_TIMEOUT_S})")
            wait_for_sentinels([p.sentinel for p in self.workers], timeout=JOIN_POLL_S)  # wakes on an exit

    def _check_workers(self) -> None:
        if self._closed:
            raise RuntimeError("this tensor-parallel executor is closed")
        self._raise_worker_error(None)
        self._raise_if_worker_exited(None)

    def _raise_if_worker_exited(self, cause: BaseException | None) -> None:
        """Name a worker that has exited (a killed one reports nothing of its own)."""
        dead = [p for p in self.workers if not p.is_alive()]
        if dead:
            self._healthy = False
            raise RuntimeError(f"tensor-parallel worker {dead[0].name} exited (code {dead[0].exitcode})") from cause

    def _raise_worker_error(self, cause: BaseException | None) -> None:
        """Raise a worker's reported error, if any. When ``cause`` says a peer left, wait up
        to 5 s for its report while every worker still runs (one may be writing it); once one
        has exited, only briefly: a worker flushes its report before it exits (a worker that
        died in start-up, before ``_worker_main``, has none; one killed by a signal neither)."""
        killed = any(p.exitcode is not None and p.exitcode < 0 for p in self.workers)
        exited = any(p.exitcode is not None for p in self.workers)
        try:
            if cause is None or killed:
                rank, tb = self._errors.get_nowait()
            else:
                rank, tb = self._errors.get(timeout=0.5 if exited else 5.0)
        except (queue.Empty, OSError, ValueError):
            return
        self._healthy = False
        raise RuntimeError(f"tensor-parallel worker rank {rank} failed:\n{tb}") from cause

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self._wedged and not self._healthy and self._symm_mem \
                and not self._gpu_drains():
            # A step submitted before the failure was seen (one step ahead) waits in a
            # symmetric-memory all-reduce for the dead peer.
            self._wedged = True
            warnings.warn(WEDGED_NOTE, RuntimeWarning, stacklevel=2)
        if self._wedged:  # any GPU call could wait on the stuck kernel: only end the workers
            self._terminate()
            return
        if self._healthy and all(p.is_alive() for p in self.workers):
            try:
                self.plans.send(None)
            except Exception:  # a peer already gone: terminate below
                self._healthy = False
        if self._healthy:
            self.local.close()
        _leave_group()  # while the workers leave it too
        for p in self.workers:
            p.join(timeout=JOIN_TIMEOUT_S if self._healthy else 0.5)
        self._terminate()

    def _gpu_drains(self, timeout_s: float = DRAIN_WAIT_S) -> bool:
        """Whether rank 0's stream finishes its queued work within ``timeout_s``, polled
        (a synchronize would wait for good on a kernel whose peer is gone)."""
        local = getattr(self, "local", None)
        if local is None or local.device.type != "cuda":
            return True
        stream = torch.cuda.current_stream(local.device)
        deadline = time.monotonic() + timeout_s
        while not stream.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _watch_workers(self) -> None:
        """(CUDA) Abort the NCCL communicators when a worker dies before ``close``."""
        wait_for_sentinels([p.sentinel for p in self.workers])
        if not self._closed:
            self._healthy = False
            if self._symm_mem:
                # The driver polls its step (``_CheckedHandle``) and sees the verdict; an
                # abort here could wait on a symmetric-memory kernel that never ends.
                return
            try:
                _leave_group()
            except Exception:  # the main thread reports the worker's error
                pass

    def _terminate(self) -> None:
        for p in self.workers:
            if p.is_alive():
                p.terminate()
        for p in self.workers:
            p.join(timeout=JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(timeout=JOIN_TIMEOUT_S)
        self.plans.close()


class _CheckedHandle:
    """Rank 0's step handle; its result is trusted only while every worker is alive
    (an aborted collective lets the step finish with garbage)."""

    def __init__(self, handle: StepHandle, executor: TPExecutor) -> None:
        self.handle, self.executor = handle, executor

    def result(self) -> StepResult:
        ready = getattr(self.handle, "ready", None)  # CUDA steps have it
        if ready is not None and self.executor._symm_mem:
            # A one-shot all-reduce whose peer died spins on the GPU for good (no abort
            # releases it, as one does NCCL's): wait by polling, so the watchdog's
            # verdict still reaches the caller.
            while not ready():
                if not self.executor._healthy:
                    # This rank's stream now waits for good: nothing on this GPU may be
                    # waited for again in this process (``close`` only ends the workers).
                    self.executor._wedged = True
                    try:
                        self.executor._check_workers()
                        raise RuntimeError("tensor-parallel group failed during this step")
                    except RuntimeError as e:
                        raise RuntimeError(f"{e}\n{WEDGED_NOTE}") from e.__cause__
                time.sleep(POLL_S)
        out = self.handle.result()
        if not self.executor._healthy:  # the watchdog aborted the collectives: say why
            self.executor._check_workers()
            raise RuntimeError("tensor-parallel group failed during this step")
        return out


# Whether this process has set up symmetric memory before. torch keeps its group state by
# group name, and a later process group reuses the name ("0") with a new store: the second
# tensor-parallel LLM of one process hung in its rendezvous (torch 2.11). So once per
# process; later groups of the same process send every all-reduce to NCCL, on every rank.
_symm_mem_used = False


def _note_symm_mem(used: bool) -> None:
    global _symm_mem_used
    _symm_mem_used = _symm_mem_used or used


def _leave_group() -> None:
    """Leave the process group: gloo destroys it (every rank together); NCCL aborts its
    communicators, a local call. ``destroy_process_group`` can hang for good once NCCL
    collectives were captured in CUDA graphs (pytorch/pytorch#115388, seen here on two
    H200s); abort is also what releases collectives blocked by a dead peer."""
    if not dist.is_initialized():
        return
    nccl = dist.get_backend() == "nccl"
    if nccl and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def _close_at_exit(ref: "weakref.ReferenceType[TPExecutor]") -> None:
    executor = ref()
    if executor is not None:
        executor.close()
