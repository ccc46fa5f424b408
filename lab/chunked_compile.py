"""How long the chunked delta rule takes to compile and run its first call at a piece size,
and whether it agrees with the token-by-token kernel (Qwen3.5-9B's DeltaNet shapes: 16 q/k
heads and 32 value heads of 128; bf16 inputs, float32 state).

    PYTHONPATH=. timeout 150 python3 lab/chunked_compile.py 16
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks.delta_rule import _problem
from minivllm.kernels.gated_delta_rule_chunked import gated_delta_rule_chunked
from minivllm.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent


def main() -> None:
    chunk = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    for lens in ([100], [100, 37, 300]):
        p = _problem(lens, 16, 32, 128, "cuda")
        outs = {}
        for name, fn, kw in (("recurrent", gated_delta_rule_recurrent, {}),
                             ("chunked", gated_delta_rule_chunked, dict(chunk=chunk))):
            state = p["state"].clone()
            t0 = time.time()
            out = fn(p["q"], p["k"], p["v"], p["g"], p["beta"], state, p["cu"], p["slots"], p["init"], **kw)
            torch.cuda.synchronize()
            print(f"{lens} {name} chunk={chunk}: first call {time.time() - t0:.2f}s", flush=True)
            outs[name] = out.float(), state
        (o1, s1), (o2, s2) = outs["recurrent"], outs["chunked"]
        print(f"  max |diff| output {(o1 - o2).abs().max().item():.2e}, state {(s1 - s2).abs().max().item():.2e}",
              flush=True)


if __name__ == "__main__":
    main()
