"""How long the tensor-parallel driver spends handing one step's plan to a worker:
``PlanPipes`` (what ``TPExecutor`` uses) against a gloo ``broadcast_object_list``
(what it used before), for a batch-1 and a batch-256 decode plan. Runs on any CPU.

    python3 -m benchmarks.plan_broadcast [--steps 300]

Per mechanism and plan: the driver's time per send, and the round trip (send, the
worker unpickles, acknowledges on a second pipe).
"""

from __future__ import annotations

import argparse
import os
import pickle
import time
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.engine_host import InputsOnlyExecutor, decoding_engine
from minivllm.engine.plan import StepPlan
from minivllm.executor.base import DoneStep
from minivllm.executor.distributed import PlanPipes, free_port


def decode_plan(batch: int) -> StepPlan:
    """A decode step's plan at ``batch`` (512-token prompts, 40 steps in)."""
    plans: list[StepPlan] = []

    class Capture(InputsOnlyExecutor):
        def submit(self, plan: StepPlan) -> DoneStep:
            plans.append(plan)
            return super().submit(plan)

    decoding_engine(batch, 100, Capture())
    return plans[-1]


def _worker(plan_in: Any, ack_out: Any, port: int, steps: int) -> None:
    for _ in range(2 * steps):  # pipes: warm-up + timed
        pickle.loads(plan_in.recv_bytes())
        ack_out.send_bytes(b"k")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1)
    for _ in range(2 * steps):
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        ack_out.send_bytes(b"k")
    dist.destroy_process_group()


def measure(plan: StepPlan, steps: int) -> dict[str, tuple[float, float]]:
    ctx = mp.get_context("spawn")
    pipes = PlanPipes(ctx, 1)
    ack_in, ack_out = ctx.Pipe(duplex=False)
    port = free_port()
    worker = ctx.Process(target=_worker, args=(pipes.readers[0], ack_out, port, steps))
    worker.start()
    pipes.close_readers()

    def timed(send: Any) -> tuple[float, float]:
        for _ in range(2):  # the second pass is the measurement
            t_send, t0 = 0.0, time.perf_counter()
            for _ in range(steps):
                t = time.perf_counter()
                send()
                t_send += time.perf_counter() - t
                ack_in.recv_bytes()
            total = time.perf_counter() - t0
        return t_send / steps * 1e6, total / steps * 1e6

    out = {"pipes": timed(lambda: pipes.send(plan))}
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0)
    out["gloo broadcast_object_list"] = timed(lambda: dist.broadcast_object_list([plan], src=0))
    dist.destroy_process_group()
    worker.join()
    pipes.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    for batch in (1, 256):
        plan = decode_plan(batch)
        size = len(pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL))
        for name, (send_us, rt_us) in measure(plan, args.steps).items():
            print(f"batch {batch:3d} plan ({size / 1e3:.1f} KB), {name}: driver {send_us:.0f} us/send, "
                  f"round trip {rt_us:.0f} us", flush=True)


if __name__ == "__main__":
    main()
