"""One prefill-attention call marked for Nsight Compute: the paged kernel or SDPA on one shape.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --set full -o rep \\
        python3 -m benchmarks.prefill_profile --shape 16x1024 [--which paged|sdpa]
        [--config 64,64,4,3]

The shapes and inputs are ``benchmarks.prefill_attention``'s. The call runs three times
(compile, warm caches), the third inside the NVTX range ``profile``, so ncu's NVTX filter
profiles exactly that launch. ``--config`` is block_m,block_n,warps,stages of a
``PrefillConfig`` (default: ``default_config`` for the shape). The paged output is
checked against SDPA first, so a profile is never of a wrong kernel.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import prefill_attention as bench
from minivllm.kernels.prefill_attention import PrefillConfig, prefill_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="16x1024", choices=[s.name for s in bench.SHAPES if s.prefix == 0
                                                           and len(set(s.q_lens)) == 1])
    ap.add_argument("--which", choices=("paged", "sdpa"), default="paged")
    ap.add_argument("--config", default=None, help="block_m,block_n,warps,stages (default: default_config)")
    args = ap.parse_args()
    shape = next(s for s in bench.SHAPES if s.name == args.shape)
    p = bench.make_problem(shape)
    config = PrefillConfig(*(int(x) for x in args.config.split(","))) if args.config else None
    sdpa = bench.sdpa_fn(p, shape, None)

    def paged() -> torch.Tensor:
        return prefill_attention(p.q, p.k_cache, p.v_cache, p.cu_seqlens_q, p.kv_lens, p.block_tables,
                                 bench.SCALE, p.max_q_len, config=config)
    fn = paged if args.which == "paged" else sdpa
    if args.which == "paged":
        bench.max_error(paged(), bench.sdpa_as_tokens(sdpa()).float())
    for i in range(3):
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
        fn()
        if i == 2:
            torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(f"{args.which} {shape.name} {config or 'default config'}: profiled one call")


if __name__ == "__main__":
    main()
