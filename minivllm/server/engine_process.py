"""The engine in its own process (``serve --engine-process``), so that the HTTP event
loop and the engine's Python work stop sharing one GIL.

::

    server process                                     engine process (spawned)
    event loop (HTTP) --commands--> engine thread      LLM(model, ...): the engine
                                    (AsyncEngine)  --admit / abort--> validate, add, abort
                                    detokenize  <---- per step: StepOutputs + counts ----  step()

In one process the engine thread's host work (scheduling, plans, outputs: a few ms
per step at batch 256) and the event loop's per-chunk work (a chunk per stream per
step) take turns on the GIL, so each slows the other (``docs/tuning.md``, "Host path").
Here the engine process steps on its
own, one step after another, and sends each step's new tokens (``StepOutput``: the
tokens new in the step, not whole completions) down a pipe; the server process's
engine thread detokenizes and hands them to the event loop as before. Admission is
still all-or-none per HTTP call, answered by the engine process within a step.

The engine-facing hooks of ``AsyncEngine`` (``_admit``, ``_abort``, ``_has_work``,
``_step``, ``_counts``) are all this class replaces; the rest (queues, detokenizers,
stop-string holdback, metrics) is shared. If the engine process dies or raises,
every waiting request fails with ``EngineDeadError`` (``/health`` answers 500), also
when it dies while idle: a watcher thread wakes the engine thread at its exit.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
import weakref
from collections.abc import Collection
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from typing import TYPE_CHECKING, Any, Callable

from minivllm import envs
from minivllm.llm import LLM, load_tokenizer, resolve_model_path
from minivllm.model.hf_config import read_model_config
from minivllm.sampling import SamplingParams
from minivllm.server.engine_loop import (NO_COUNTS, AsyncEngine, EngineDeadError, ScheduleWatch, StepCounts,
                                         StepOutput, admit_into, engine_counts, step_output)

if TYPE_CHECKING:
    from minivllm.server.metrics import ServerMetrics

STARTUP_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0
# Cores the server process keeps busy beside the engine process: its event loop and
# engine thread (HTTP, detokenizing, the pipes) share one GIL, so about one.
SERVER_PROCESS_CORES = 1


class LLMFront:
    """What the server process needs of a model without loading it: the tokenizer,
    the config, and ``LLM``'s prompt checks (the same functions, so both modes check
    prompts alike).

    Args:
        model: the checkpoint directory (or hub id) the engine process loads.
    """

    prompt_token_ids = LLM.prompt_token_ids
    chat_prompt_ids = LLM.chat_prompt_ids
    chat_prompt_text = LLM.chat_prompt_text
    _require_tokenizer = LLM._require_tokenizer

    def __init__(self, model: str) -> None:
        path = resolve_model_path(model, weights=False)  # the engine process loads (or fills) them
        self.model_config = read_model_config(path)
        self.tokenizer = load_tokenizer(path)


class ProcessAsyncEngine(AsyncEngine):
    """An ``AsyncEngine`` whose engine runs in a spawned process.

    Args:
        model: checkpoint for ``LLM`` in the engine process; or a picklable callable that
            builds an ``LLM``-like object there from ``llm_options`` (``engine``,
            ``scheduler_config``, ``close``: e.g. a fake engine in a test).
        llm_options: ``LLM``'s keyword arguments there (device, dtype, engine options).
        tokenizer: this process's tokenizer (the detokenizers).
        metrics: as for ``AsyncEngine``.

    Raises:
        RuntimeError: the engine process failed to start (its traceback included).
    """

    def __init__(self, model: str | Callable[..., Any], llm_options: dict[str, Any], tokenizer: Any,
                 metrics: ServerMetrics | None = None) -> None:
        super().__init__(None, tokenizer, metrics)  # type: ignore[arg-type]
        ctx = mp.get_context("spawn")
        cmd_in, self._cmds = ctx.Pipe(duplex=False)
        self._outs, out_w = ctx.Pipe(duplex=False)
        # Not a daemon: it starts tensor-parallel workers of its own. It leaves when told
        # to, when its command pipe closes (this process gone), or at our exit (below).
        self._proc = ctx.Process(target=_core_main, args=(cmd_in, out_w, model, llm_options),
                                 name="minivllm-engine-core")
        self._proc.start()
        atexit.register(_stop_at_exit, weakref.ref(self))
        cmd_in.close()
        out_w.close()
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # sent by its own thread:
        self._sender = threading.Thread(target=self._send_loop, name="minivllm-engine-send", daemon=True)
        self._sender.start()  # the engine thread never blocks on a full pipe while the core does too
        # Steps received while waiting for an admission verdict: (outputs, counts), in order.
        self._pending: collections.deque[tuple[list[StepOutput], StepCounts]] = collections.deque()
        self._work = False
        self._counts_of_step = NO_COUNTS
        try:
            if not self._outs.poll(STARTUP_TIMEOUT_S):
                raise RuntimeError(f"the engine process did not start within {STARTUP_TIMEOUT_S:.0f} s")
            message = self._recv()  # raises with the process's traceback if it failed
        except BaseException:
            self._stop_process()
            raise
        self._max_model_len = int(message[1])
        self.pid = self._proc.pid
        self._exited = threading.Event()  # set once the engine process has ended
        threading.Thread(target=self._watch_process, name="minivllm-engine-watch", daemon=True).start()

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def error(self) -> EngineDeadError | None:
        """Also set as soon as the engine process is gone, before any request notices
        (``/health`` reads it)."""
        if self._error is None and not self._proc.is_alive():
            return EngineDeadError(f"the engine process exited (code {self._proc.exitcode})")
        return self._error

    def close(self, timeout: float = 30.0) -> None:
        super().close(timeout)
        self._stop_process()

    # ---- the engine-facing hooks (engine thread) ------------------------------

    def _admit(self, batch: list[tuple[tuple[str, ...], list[list[int]], SamplingParams]]
               ) -> list[BaseException | None]:
        self._outbox.put(("admit", batch))
        while True:  # the core answers within a step; steps before the answer are kept
            message = self._recv()
            if message[0] == "admitted":
                verdicts: list[BaseException | None] = message[1]
                self._work = self._work or any(v is None for v in verdicts)
                return verdicts
            self._pending.append(self._take_step(message))

    def _abort(self, request_ids: list[str]) -> None:
        self._outbox.put(("abort", request_ids))

    def _has_work(self) -> bool:
        if self._exited.is_set():
            self._raise_exit()
        return bool(self._pending) or self._work

    def _step(self) -> tuple[list[StepOutput], StepCounts]:
        """The next step's outputs and counts. The core has work whenever we think so: it
        leaves its last request only by a step (``LLMEngine`` reports even an abort in a
        step), and that step's message says it is idle."""
        step = self._pending.popleft() if self._pending else self._take_step(self._recv())
        self._counts_of_step = step[1]
        return step

    def _take_step(self, message: tuple[Any, ...]) -> tuple[list[StepOutput], StepCounts]:
        """A step message's outputs and counts; its idle flag applies now (messages are
        read in the order the core sent them)."""
        if message[0] != "step":
            raise RuntimeError(f"engine process: unexpected message {message[0]!r}")
        _, outputs, counts, self._work = message
        return outputs, counts

    def _counts(self) -> StepCounts:
        return dataclasses.replace(self._counts_of_step, batch_size=0, first_scheduled=())

    # ---- plumbing -------------------------------------------------------------

    def _recv(self) -> tuple[Any, ...]:
        """The next message from the engine process; its failure or exit raises here."""
        try:
            message = self._outs.recv()
        except (EOFError, OSError):
            self._proc.join(1.0)
            raise RuntimeError(f"the engine process exited (code {self._proc.exitcode})") from None
        if message[0] == "failed":
            raise RuntimeError(f"the engine process failed:\n{message[1]}")
        return message

    def _watch_process(self) -> None:
        """Wake the engine thread when the engine process ends, so that a death while the
        server is idle fails the engine at once (``_has_work``), not at the next request."""
        wait_ready([self._proc.sentinel])
        self._exited.set()
        self._wakeup.set()

    def _raise_exit(self) -> None:
        """The engine process is gone: raise its failure (with its traceback, if it sent one)."""
        while self._outs.poll():
            self._recv()  # raises at the failure message, or at the pipe's end
        raise RuntimeError(f"the engine process exited (code {self._proc.exitcode})")

    def _send_loop(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._cmds.send(message)
            except (OSError, ValueError):  # the core is gone: the engine thread hears of it
                return

    def _stop_process(self) -> None:
        self._outbox.put(("stop",))
        self._outbox.put(None)
        self._sender.join(JOIN_TIMEOUT_S)
        self._outs.close()  # a core blocked sending a step (nobody reads any more) fails and exits
        self._proc.join(JOIN_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(JOIN_TIMEOUT_S)
        self._cmds.close()


def _stop_at_exit(ref: "weakref.ReferenceType[ProcessAsyncEngine]") -> None:
    """Before multiprocessing joins its children at exit (it would wait for ever)."""
    engine = ref()
    if engine is not None:
        engine.close()


def engine_num_threads(cpus: Collection[int], default: int) -> int:
    """Torch intra-op threads for the engine process: the CPUs it may run on (``cpus``)
    less the server process's share, no more than torch's ``default``, at least 1.

    torch's default is a thread per core, the server process's included; its OpenMP
    workers spin while they wait, so the server process's threads wait for a core
    behind them (``docs/tuning.md``, "Host path").
    """
    return max(1, min(default, len(cpus) - SERVER_PROCESS_CORES))


def _usable_cpus() -> Collection[int]:
    """The CPUs this process may run on: its affinity mask where the OS has one."""
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return range(os.cpu_count() or 1)


def size_torch_threads() -> None:
    """Size torch's thread pool (``engine_num_threads``) before a model is built, unless
    ``OMP_NUM_THREADS`` did: the engine process's, and the chat command's (one process whose
    main thread does the Python work beside torch's)."""
    if envs.omp_num_threads_set():
        return
    import torch  # here: the server process never imports torch

    torch.set_num_threads(engine_num_threads(_usable_cpus(), torch.get_num_threads()))


def _core_main(cmds: Connection, outs: Connection, model: str | Callable[..., Any],
               llm_options: dict[str, Any]) -> None:
    """The engine process: build the LLM, then apply commands and step until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's; it stops us
    try:
        size_torch_threads()
        llm = model(**llm_options) if callable(model) else LLM(model, **llm_options)
        engine = llm.engine
        watch = ScheduleWatch()
        outs.send(("ready", llm.scheduler_config.max_model_len))
        while True:
            busy = engine.has_unfinished_requests()
            if busy and not cmds.poll():
                start = time.monotonic()
                outputs = [step_output(o) for o in engine.step()]
                outs.send(("step", outputs, engine_counts(engine, watch, start), engine.has_unfinished_requests()))
                continue
            try:
                message = cmds.recv()  # idle: wait for work
            except EOFError:  # the server is gone
                break
            if message[0] == "stop":
                break
            if message[0] == "admit":
                outs.send(("admitted", [admit_into(engine, *item) for item in message[1]]))
            elif message[0] == "abort":
                for rid in message[1]:
                    engine.abort_request(rid)
        llm.close()
    except BaseException:
        try:
            outs.send(("failed", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
