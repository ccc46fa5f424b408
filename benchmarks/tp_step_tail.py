"""The non-layer kernels of a tensor-parallel decode step, on one GPU: the vocab-parallel
embedding lookup and the sampling from vocab shards, as the previous torch ops and as the
one-launch kernels that replaced them; and TP=1's greedy ``argmax`` against the same
kernel on the whole row.

    python3 -m benchmarks.tp_step_tail [--tp 2] [--hidden 4096] [--vocab 151936]

Each variant is captured REPEAT times in one CUDA graph and the graph replayed
(``benchmarks.gpu_timing.graph_us``: median of replays, per call): back-to-back launches
as a step's stream runs them, with the gaps
between kernels counted, which ``do_bench``'s per-call events would blur. Rows 1, 8 and
256; bf16 logits and table. The collectives (the embedding's all-reduce, the pairs'
all-gather) are not here: they are the same before and after. Before timing, every
variant's output is checked equal to its old form's. With ``$OUT`` set the results go to
``$OUT/tp_step_tail.json`` too.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu_timing import graph_us
from benchmarks.throughput import write_summary
from minivllm.kernels.gumbel_sample import gumbel_pairs, gumbel_sample
from minivllm.kernels.reference import vocab_shard_embedding_reference
from minivllm.kernels.vocab_embedding import vocab_shard_embedding

REPEAT = 20  # calls per graph
ROWS = (1, 8, 256)


def old_shard_pairs(shard: torch.Tensor, offset: int) -> torch.Tensor:
    """The previous greedy shard path: ``max`` then the pair built in torch."""
    value, col = shard.max(dim=-1)
    return torch.stack([value.float(), (col + offset).float()], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shard_cols = -(-args.vocab // args.tp)
    offset = shard_cols * (args.tp - 1)  # the last rank's columns
    table = torch.randn(shard_cols, args.hidden, device=dev, generator=gen).to(torch.bfloat16)
    counts = torch.zeros(256, dtype=torch.int32, device=dev)
    results = []
    for rows in ROWS:
        ids = torch.randint(0, args.vocab, (rows,), device=dev, generator=gen)
        lookup = (ids, table, offset, args.vocab)
        want = vocab_shard_embedding_reference(*lookup)
        assert torch.equal(vocab_shard_embedding(*lookup), want), "embedding differs"
        shard = torch.randn(rows, shard_cols, device=dev, generator=gen).to(torch.bfloat16)
        whole = torch.randn(rows, args.vocab, device=dev, generator=gen).to(torch.bfloat16)
        temp = torch.ones(rows, device=dev)
        greedy = torch.ones(rows, dtype=torch.bool, device=dev)
        seeded = torch.zeros(rows, dtype=torch.bool, device=dev)
        keys = torch.zeros(rows, 2, dtype=torch.int64, device=dev)

        def new_pairs():
            return gumbel_pairs(shard, temp, None, greedy, seeded, keys, 7, col_offset=offset, counts=counts)

        def new_tokens():
            return gumbel_sample(whole, temp, None, greedy, seeded, keys, 7, counts=counts)

        assert torch.equal(new_pairs(), old_shard_pairs(shard, offset)), "shard pairs differ"
        assert torch.equal(new_tokens(), whole.argmax(dim=-1)), "greedy tokens differ"
        row = {
            "rows": rows,
            "embedding_torch_us": graph_us(lambda i: vocab_shard_embedding_reference(*lookup), REPEAT),
            "embedding_kernel_us": graph_us(lambda i: vocab_shard_embedding(*lookup), REPEAT),
            "shard_pairs_torch_us": graph_us(lambda i: old_shard_pairs(shard, offset), REPEAT),
            "shard_pairs_kernel_us": graph_us(lambda i: new_pairs(), REPEAT),
            "greedy_argmax_us": graph_us(lambda i: whole.argmax(dim=-1), REPEAT),
            "greedy_kernel_us": graph_us(lambda i: new_tokens(), REPEAT),
        }
        results.append(row)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    write_summary("tp_step_tail", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
