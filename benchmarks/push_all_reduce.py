"""What the pushed one-row all-reduce (``kernels/_push_all_reduce.py``) costs inside its two
GEMVs, on one GPU: every rank's kernels in this process, one after the other.

    python3 -m benchmarks.push_all_reduce [--shapes qwen3-8b] [--tp 2] [--layers 36]

A batch-1 decode step's GEMVs at TP shapes, per layer and rank: ``o_proj`` then the normed
``gate_up_proj``, the gated ``down_proj`` then the next layer's normed ``qkv_proj``. Two CUDA
graphs of the whole step, timed by replaying them in turn:

- plain: each rank's GEMVs on its own partial sums (no sum over ranks: what the step's GEMVs
  cost with the collective taken away);
- pushed: the same GEMVs with ``push`` and ``reduce``: the producers also store their tiles
  into the "peers'" inboxes (here on this GPU) and count them, the consumers wait (the count
  is already there: the ranks run in turn) and sum the ranks' rows.

The difference is the protocol's own work per call, without the NVLink latency that only two
GPUs have (``benchmarks.tp_scaling`` measures the step end to end there). The layers cycle
through 8 sets of weights, so W streams from HBM as in the model.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.qwen3_shapes import SHAPES
from minivllm.kernels.gemv import gemv, rms_norm_gemv
from minivllm.layers.all_reduce import ranks_in_one_process

DISTINCT_LAYERS = 8


def layer_weights(shape: dict, tp: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """One rank's shards of a layer's four projections (random bf16), per rank."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    d = shape.get("head_dim", h // shape["num_attention_heads"])
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def w(n: int, k: int) -> torch.Tensor:
        return (0.02 * torch.randn(n, k, generator=gen, device="cuda")).to(torch.bfloat16)

    return [dict(o=w(h, q // tp), gate_up=w(2 * i // tp, h), down=w(h, i // tp), qkv=w((q + 2 * kv) // tp, h))
            for _ in range(tp)]


def step(layers: list[list[dict]], paths: list, acts: dict, push: bool, num_layers: int) -> None:
    """One batch-1 step's GEMVs over ``num_layers`` layers, every rank in turn."""
    tp, n = len(paths), acts["residual"].shape[1]
    for layer in range(num_layers):
        ws = layers[layer % len(layers)]
        for proj, attn_in, consumer in (("o", acts["attn"], "gate_up"), ("down", acts["gate_up"], "qkv")):
            rows = [path.push_target((1, n), torch.bfloat16) if push else None for path in paths]
            outs = []
            for rank in range(tp):
                gated = proj == "down"
                x = attn_in[rank]
                if push:
                    outs.append(gemv(x, ws[rank][proj], out=rows[rank].out, gated=gated, push=rows[rank].channel))
                else:
                    outs.append(gemv(x, ws[rank][proj], gated=gated))
            for rank in range(tp):
                nw = acts["norm_weight"]
                if push:
                    rms_norm_gemv(rows[rank].slots, acts["residual"], nw, 1e-6, ws[rank][consumer],
                                  reduce=rows[rank].channel)
                else:
                    rms_norm_gemv(outs[rank], acts["residual"], nw, 1e-6, ws[rank][consumer])


def time_graphs(graphs: dict[str, torch.cuda.CUDAGraph], replays: int) -> dict[str, float]:
    """Median us per replay of each graph, the graphs replayed in turn."""
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(replays):
        for name, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="default: the model's")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    shape = SHAPES[args.shapes][1]
    num_layers = args.layers or shape["num_hidden_layers"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = [layer_weights(shape, args.tp, gen) for _ in range(DISTINCT_LAYERS)]
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape.get("head_dim", h // shape["num_attention_heads"])
    bf = dict(device="cuda", dtype=torch.bfloat16)
    acts = dict(attn=[torch.randn(1, q // args.tp, **bf) for _ in range(args.tp)],
                gate_up=[torch.randn(1, 2 * i // args.tp, **bf) for _ in range(args.tp)],
                residual=torch.randn(1, h, **bf), norm_weight=torch.ones(h, **bf))
    paths = ranks_in_one_process(args.tp, torch.bfloat16, "cuda", max_numel=1 << 16)
    graphs = {}
    for name, push in (("plain", False), ("pushed", True)):
        step(layers, paths, acts, push, num_layers)  # compile
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            step(layers, paths, acts, push, num_layers)
    med = time_graphs(graphs, args.replays)
    calls = 2 * num_layers * args.tp  # producer + consumer pairs, per rank
    per_call = (med["pushed"] - med["plain"]) / calls
    print(f"{args.shapes} TP={args.tp}, {num_layers} layers, ranks in turn on one GPU: GEMVs of a batch-1 step "
          f"plain {med['plain']:.0f} us, pushed {med['pushed']:.0f} us; the push's own work "
          f"{per_call:+.2f} us per producer + consumer pair and rank ({calls} pairs)")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "push_all_reduce.json"), "w") as f:
            json.dump({"args": vars(args), "median_us": med, "per_pair_us": per_call}, f, indent=1)


if __name__ == "__main__":
    main()
