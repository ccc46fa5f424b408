"""Question: which pass-step and tile sizes make the MoE alignment fastest at decode and at
prefill sizes, and what does the k-row sum cost as one kernel against torch's two?

The alignment (``kernels/moe_align.py``) walks the pairs in dependent steps of CHUNK pairs:
one program walks all of them twice; the grid's programs walk ``tile_chunks`` chunks each,
and a scan walks one row per tile. This times,
captured in CUDA graphs, every variant at Qwen3-30B-A3B's routing (128 experts, top-8) for
several token counts, each layout first checked equal to the default's, and
``kernels/moe_sum.py`` against ``sum(dtype=float32)`` + ``copy_`` into bf16::

    PYTHONPATH=. python3 lab/moe_align_tiles.py [--tokens 8,64,256,2048,16384]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/moe_align_tiles.py --check   # CPU: layouts only
"""

from __future__ import annotations

import argparse

import torch

from minivllm.kernels.moe_align import moe_align
from minivllm.kernels.moe_sum import moe_sum

EXPERTS, TOP_K, HIDDEN = 128, 8, 2048
CALLS = 48  # one call a layer, as in a step


def variants(pairs: int) -> dict[str, dict]:
    out = {"default": {}}
    if pairs <= 4096:
        out.update({f"one program chunk {c}": dict(one_program=True, chunk=c) for c in (16, 32, 64)})
    out.update({f"grid chunk {c} tile {t}": dict(one_program=False, chunk=c, tile_chunks=t)
                for c in (16, 32, 64) for t in (1, 2, 4, 8, 16)})
    return out


def routing(tokens: int, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.rand(tokens, EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K]
    return ids.to(torch.int32).contiguous().to(device)


def same_layout(a, b) -> bool:
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("sorted_pair_ids", "block_expert", "num_blocks"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="8,64,256,2048,16384")
    ap.add_argument("--check", action="store_true", help="layouts only, on the CPU (interpreter)")
    args = ap.parse_args()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    device = "cpu" if args.check else "cuda"
    if args.check:
        tokens_list = [min(t, 64) for t in tokens_list[:2]]
    for tokens in tokens_list:
        ids = [routing(tokens, device, s) for s in range(CALLS if not args.check else 1)]
        pairs = tokens * TOP_K
        base = moe_align(ids[0], EXPERTS)
        times = {}
        for name, kw in variants(pairs).items():
            if not same_layout(moe_align(ids[0], EXPERTS, **kw), base):
                raise AssertionError(f"{tokens} tokens, {name}: another layout")
            if not args.check:
                from benchmarks.gpu_timing import graph_us
                times[name] = graph_us(lambda i, kw=kw: moe_align(ids[i], EXPERTS, **kw), CALLS)
        if args.check:
            print(f"{tokens} tokens: {len(variants(pairs))} variants, layouts equal")
            continue
        ranked = sorted(times.items(), key=lambda kv: kv[1])
        print(f"align at {tokens} tokens ({pairs} pairs): default {times['default']:.2f} us; best "
              + ", ".join(f"{k} {v:.2f}" for k, v in ranked[:6]), flush=True)
        rows = torch.randn(pairs, HIDDEN, device=device).to(torch.bfloat16)
        out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        ours = graph_us(lambda i: moe_sum(rows, TOP_K, out), CALLS)
        theirs = graph_us(lambda i: out.copy_(rows.view(tokens, TOP_K, HIDDEN).sum(dim=1, dtype=torch.float32)),
                          CALLS)
        print(f"k-row sum at {tokens} tokens: moe_sum {ours:.2f} us, torch sum + copy {theirs:.2f} us", flush=True)


if __name__ == "__main__":
    main()
