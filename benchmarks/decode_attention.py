"""Paged decode-attention bandwidth on the GPU, as a share of the copy bandwidth: decode is
bound by reading K/V, so the copy rate is its ceiling.

    PYTHONPATH=. python3 -m benchmarks.decode_attention [--sweep] [--no-engine] [--block-size 64]

Qwen3-0.6B attention shapes (16 query heads, 8 KV heads, head_dim 128), bf16, blocks of the
engine's CUDA default, every sequence at the full context, its blocks scattered at random
over the pool. Bytes counted are the least any decode kernel moves: K and V of every
context token, q, the output, the block tables and kv_lens. Times: ``do_bench`` median (L2
flushed between calls) and replays of a CUDA graph (``benchmarks.gpu_timing``); every
config is checked against the float32 reference first. ``--sweep`` also times other tile
configs and split counts (tuning).

The engine-like section replays decode attention as the engine's CUDA graphs run it
(``executor/cuda_graph.py``): captured with kv_lens 0 and tables of -1 as wide as
max_model_len, then filled with 16 sequences at context 8192; one layer and a 28-layer
graph over one (L, 2, N, bs, Hkv, D) cache, over split counts and block placements, and an
all-padding replay (the per-step launch and merge cost).

Summary: ``$OUT/decode_attention.json``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import triton

from benchmarks.gpu_timing import capture_graph, copy_bandwidth_gbs, graph_us, replay_us
from benchmarks.report import write_summary
from minivllm.kernels.decode_attention import DecodeConfig, choose_num_splits, decode_attention, default_config
from minivllm.kernels.reference import paged_attention_reference
from minivllm.llm import CUDA_BLOCK_SIZE

# Blocks as the engine makes them on CUDA (--block-size overrides).
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, CUDA_BLOCK_SIZE
SHAPES = [(1, 512), (64, 1024), (256, 1024), (8, 8192), (16, 8192)]  # (batch, context); 1 x 512: batch-1 decode
DTYPE = torch.bfloat16
DEVICE = "cuda"   # a module constant so that a CPU dry run (TRITON_INTERPRET=1) can swap it


@dataclass(frozen=True)
class Problem:
    """One decode batch at full context, on the GPU."""

    q: torch.Tensor             # (B, H, D)
    k_cache: torch.Tensor       # (N, bs, Hkv, D)
    v_cache: torch.Tensor
    kv_lens: torch.Tensor       # (B,) int32
    block_tables: torch.Tensor  # (B, W) int32

    @property
    def bytes_moved(self) -> int:
        """Least bytes any decode kernel reads/writes: context K/V, q, out, tables, lengths."""
        batch, context = self.q.shape[0], int(self.kv_lens[0])
        kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * self.k_cache.element_size()
        q_out = 2 * self.q.numel() * self.q.element_size()
        return kv + q_out + self.block_tables.numel() * 4 + self.kv_lens.numel() * 4


def make_problem(batch: int, context: int, seed: int = 0) -> Problem:
    """Random q/K/V; each sequence's blocks are drawn at random from the whole pool."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    width = context // BLOCK_SIZE
    num_blocks = batch * width
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return Problem(
        q=torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE),
        k_cache=torch.randn(shape, generator=gen, device=DEVICE).to(DTYPE),
        v_cache=torch.randn(shape, generator=gen, device=DEVICE).to(DTYPE),
        kv_lens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
        block_tables=torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32).view(batch, width),
    )


def check(p: Problem, num_splits: int | None, config: DecodeConfig | None) -> float:
    """Max abs error vs the fp32 reference (raises if beyond the bf16 tolerance)."""
    out = decode_attention(p.q, p.k_cache, p.v_cache, p.kv_lens, p.block_tables, HEAD_DIM ** -0.5,
                           num_splits=num_splits, config=config)
    cu = torch.arange(p.q.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_reference(p.q.float(), p.k_cache.float(), p.v_cache.float(), cu, p.kv_lens,
                                    p.block_tables, HEAD_DIM ** -0.5)
    err = (out.float() - ref).abs().max().item()
    if not err <= 1.6e-2:
        raise AssertionError(f"decode_attention differs from the reference by {err}")
    return err


def time_us(p: Problem, num_splits: int | None, config: DecodeConfig | None) -> tuple[float, float]:
    """(do_bench median, CUDA-graph replay median), microseconds."""
    def fn() -> torch.Tensor:
        return decode_attention(p.q, p.k_cache, p.v_cache, p.kv_lens, p.block_tables, HEAD_DIM ** -0.5,
                                num_splits=num_splits, config=config)
    eager = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return eager * 1e3, graph_us(lambda _: fn(), GRAPH_CALLS)


def sweep(problems: dict[tuple[int, int], Problem], copy_gbs: float) -> None:
    """Time tile configs and split counts; print one line each (tuning aid)."""
    configs = [DecodeConfig(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
    for (batch, context), p in problems.items():
        sm = torch.cuda.get_device_properties(0).multi_processor_count
        for cfg in configs:
            splits = choose_num_splits(batch, NUM_KV_HEADS, context, sm, cfg.block_n)
            _sweep_line(p, batch, context, splits, cfg, copy_gbs)
        for splits in (1, 2, 4, 8, 16, 32):
            _sweep_line(p, batch, context, splits, None, copy_gbs)


def _sweep_line(p: Problem, batch: int, context: int, splits: int, cfg: DecodeConfig | None,
                copy_gbs: float) -> None:
    """Check, time (do_bench median) and print one (config, splits) point; a failure is printed, not raised."""
    def fn() -> torch.Tensor:
        return decode_attention(p.q, p.k_cache, p.v_cache, p.kv_lens, p.block_tables, HEAD_DIM ** -0.5,
                                num_splits=splits, config=cfg)
    try:
        check(p, splits, cfg)
        us = triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3
    except Exception as exc:  # noqa: BLE001 - a tuning sweep reports a failing point and goes on
        print(f"sweep b{batch} ctx{context} splits={splits} {cfg}: FAILED {type(exc).__name__}: {exc}")
        return
    gbs = p.bytes_moved / (us * 1e-6) / 1e9
    print(f"sweep b{batch:<4d} ctx{context:<5d} splits={splits:<3d} {cfg}  {us:8.1f} us  "
          f"{gbs:6.0f} GB/s  {100 * gbs / copy_gbs:5.1f}%", flush=True)


ENGINE_BATCH, ENGINE_CONTEXT, ENGINE_MAX_MODEL_LEN, ENGINE_LAYERS = 16, 8192, 16384, 28
ENGINE_POOL_FACTOR = 4          # pool blocks per layer / blocks the batch needs
PLACEMENTS = ("contiguous", "interleaved", "random")
SCALE = HEAD_DIM ** -0.5
GRAPH_CALLS = 10                # calls per captured graph in time_us


@dataclass(frozen=True)
class GraphBuffers:
    """Static decode inputs of one captured batch size, kept as ``CudaGraphRunner`` keeps them."""

    q: torch.Tensor             # (L, B, H, D): each layer's queries
    kv_lens: torch.Tensor       # (B,) int32: 0 while capturing, the real contexts at replay
    block_tables: torch.Tensor  # (B, W) int32: -1 while capturing, W = max_model_len / bs
    kv_cache: torch.Tensor      # (L, 2, N, bs, Hkv, D): all layers' K/V, as the executor allocates it


def make_buffers(batch: int, width: int, num_layers: int, pool_blocks: int) -> GraphBuffers:
    """Zeroed cache (values do not change the timing) except layer 0, random for the check."""
    gen = torch.Generator(DEVICE).manual_seed(1)
    kv_cache = torch.zeros(num_layers, 2, pool_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
                           dtype=DTYPE, device=DEVICE)
    kv_cache[0].normal_(generator=gen)
    return GraphBuffers(
        q=torch.randn(num_layers, batch, NUM_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE),
        kv_lens=torch.zeros(batch, dtype=torch.int32, device=DEVICE),
        block_tables=torch.full((batch, width), -1, dtype=torch.int32, device=DEVICE),
        kv_cache=kv_cache)


def capture(buf: GraphBuffers, num_layers: int, num_splits: int | None) -> tuple[torch.cuda.CUDAGraph,
                                                                                   list[torch.Tensor]]:
    """A graph of one decode_attention per layer, captured as the engine does: kv_lens 0, tables -1.

    Returns the graph and its per-layer outputs (graph-pool memory, rewritten by each replay).
    """
    buf.kv_lens.zero_()
    buf.block_tables.fill_(-1)

    def step(_: int) -> list[torch.Tensor]:
        return [decode_attention(buf.q[layer], buf.kv_cache[layer, 0], buf.kv_cache[layer, 1], buf.kv_lens,
                                 buf.block_tables, SCALE, num_splits=num_splits) for layer in range(num_layers)]

    graph, [outs] = capture_graph(step, 1)
    return graph, outs


def fill(buf: GraphBuffers, context: int, placement: str, seed: int = 0) -> None:
    """Write the real batch into the static buffers: every sequence at ``context`` tokens."""
    batch, pool = buf.kv_lens.shape[0], buf.kv_cache.shape[2]
    need = -(-context // BLOCK_SIZE)
    if placement == "contiguous":      # a fresh pool after one prefill per sequence
        ids = torch.arange(batch * need, device=DEVICE).view(batch, need)
    elif placement == "interleaved":   # sequences that grew together, one block at a time
        ids = torch.arange(batch * need, device=DEVICE).view(need, batch).t()
    elif placement == "random":        # a long-running pool: blocks anywhere
        gen = torch.Generator(DEVICE).manual_seed(seed)
        ids = torch.randperm(pool, generator=gen, device=DEVICE)[: batch * need].view(batch, need)
    else:
        raise ValueError(f"unknown placement {placement!r}")
    buf.block_tables.fill_(-1)
    buf.block_tables[:, :need] = ids.to(torch.int32)
    buf.kv_lens.fill_(context)


def check_layer0(buf: GraphBuffers, out: torch.Tensor) -> float:
    """Max abs error of layer 0's replayed output vs the fp32 reference (raises beyond bf16 tolerance)."""
    cu = torch.arange(buf.kv_lens.shape[0] + 1, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_reference(buf.q[0].float(), buf.kv_cache[0, 0].float(), buf.kv_cache[0, 1].float(),
                                    cu, buf.kv_lens, buf.block_tables, SCALE)
    err = (out.float() - ref).abs().max().item()
    if not err <= 1.6e-2:
        raise AssertionError(f"engine-like decode differs from the reference by {err}")
    return err


def engine_like(copy_gbs: float, max_model_len: int) -> list[dict]:
    """Time decode attention replayed the way the engine's CUDA graphs run it (see the module
    doc); one row per point."""
    batch, context, layers = ENGINE_BATCH, ENGINE_CONTEXT, ENGINE_LAYERS
    width = -(-max_model_len // BLOCK_SIZE)
    pool = ENGINE_POOL_FACTOR * batch * -(-context // BLOCK_SIZE)
    heuristic = choose_num_splits(batch, NUM_KV_HEADS, width * BLOCK_SIZE,
                                  torch.cuda.get_device_properties(0).multi_processor_count,
                                  default_config(DTYPE, HEAD_DIM).block_n)
    layer_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2 + 2 * batch * NUM_HEADS * HEAD_DIM * 2
    print(f"\nengine-like decode graph: batch {batch}, ctx {context}, table width {width} (max_model_len "
          f"{max_model_len}), pool {pool} blocks/layer, heuristic splits {heuristic}; per layer "
          f"{layer_bytes / 1e6:.0f} MB = {layer_bytes / copy_gbs / 1e3:.1f} us at copy bandwidth")
    print(f"{'layers':>6} {'placement':>11} {'width':>5} {'splits':>6} {'us/step':>9} {'us/layer':>9} "
          f"{'GB/s':>6} {'%copy':>6} {'max err':>8}", flush=True)
    buf = make_buffers(batch, width, layers, pool)
    # The table width of the section above (just the context) over the same cache, for comparison.
    tight = GraphBuffers(buf.q, buf.kv_lens, buf.block_tables[:, : -(-context // BLOCK_SIZE)].clone(), buf.kv_cache)
    runs = [(1, "random", buf, s) for s in (None, 1, 2, 8, 16, 32)] + [(1, "random", tight, None)]
    runs += [(layers, p, buf, None) for p in PLACEMENTS] + [(layers, "random", buf, 8)]
    rows = [_engine_line(b, num_layers, placement, splits, heuristic, context, layer_bytes, copy_gbs)
            for num_layers, placement, b, splits in runs]
    rows.append(_engine_line(buf, layers, "padding", None, heuristic, 0, layer_bytes, copy_gbs))
    return rows


def _engine_line(buf: GraphBuffers, num_layers: int, placement: str, splits: int | None, heuristic: int,
                 context: int, layer_bytes: int, copy_gbs: float) -> dict:
    """Capture, fill, replay, check and print one engine-like point; a failure is printed and
    recorded, not raised."""
    label = f"{heuristic}*" if splits is None else str(splits)
    row: dict = dict(layers=num_layers, placement=placement, width=buf.block_tables.shape[1],
                     splits=heuristic if splits is None else splits, heuristic=splits is None)
    try:
        graph, outs = capture(buf, num_layers, splits)
        fill(buf, context, "random" if placement == "padding" else placement)
        if placement == "padding":
            buf.kv_lens.zero_()      # every row is graph padding: the fixed per-step cost
        graph.replay()
        err = check_layer0(buf, outs[0]) if context else 0.0
        us = replay_us(graph, replays=50)
    except Exception as exc:  # noqa: BLE001 - a benchmark row reports its failure and the run goes on
        print(f"{num_layers:>6} {placement:>11} {row['width']:>5} {label:>6} FAILED "
              f"{type(exc).__name__}: {exc}", flush=True)
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:200]}
    gbs = num_layers * layer_bytes / (us * 1e-6) / 1e9 if context else 0.0
    print(f"{num_layers:>6} {placement:>11} {row['width']:>5} {label:>6} {us:>9.1f} "
          f"{us / num_layers:>9.1f} {gbs:>6.0f} {100 * gbs / copy_gbs:>5.1f}% {err:>8.1e}", flush=True)
    return {**row, "us": us, "gbs": gbs, "pct_copy": 100 * gbs / copy_gbs, "max_err": err}


def timed_row(p: Problem, batch: int, context: int, num_sms: int, copy_gbs: float) -> dict:
    """Check and time the default launch of one problem; bandwidths against ``copy_gbs``."""
    err = check(p, None, None)
    eager, graph = time_us(p, None, None)
    splits = choose_num_splits(batch, NUM_KV_HEADS, context, num_sms, default_config(DTYPE, HEAD_DIM).block_n)
    e_gbs, g_gbs = p.bytes_moved / (eager * 1e-6) / 1e9, p.bytes_moved / (graph * 1e-6) / 1e9
    return dict(batch=batch, context=context, splits=splits, bytes=p.bytes_moved, eager_us=eager, eager_gbs=e_gbs,
                eager_pct_copy=100 * e_gbs / copy_gbs, graph_us=graph, graph_gbs=g_gbs,
                graph_pct_copy=100 * g_gbs / copy_gbs, max_err=err)


def print_rows(rows: list[dict], copy_gbs: float) -> None:
    print(f"\ndecode attention, bf16, H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE}, "
          f"copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} {'MB':>7} {'eager us':>9} {'GB/s':>6} {'%copy':>6} "
          f"{'graph us':>9} {'GB/s':>6} {'%copy':>6} {'max err':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>5} {r['splits']:>6} {r['bytes'] / 1e6:>7.1f} {r['eager_us']:>9.1f} "
              f"{r['eager_gbs']:>6.0f} {r['eager_pct_copy']:>5.1f}% {r['graph_us']:>9.1f} {r['graph_gbs']:>6.0f} "
              f"{r['graph_pct_copy']:>5.1f}% {r['max_err']:>8.1e}")


def main() -> None:
    global BLOCK_SIZE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time other tile configs and split counts")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-like CUDA-graph section")
    ap.add_argument("--max-model-len", type=int, default=ENGINE_MAX_MODEL_LEN,
                    help="sets the engine-like block-table width (max_model_len / block_size)")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                    help="tokens per KV cache block (the engine's CacheConfig.block_size)")
    args = ap.parse_args()
    BLOCK_SIZE = args.block_size
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.decode_attention needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)
    problems = {shape: make_problem(*shape) for shape in SHAPES}
    if args.sweep:
        sweep(problems, copy_gbs)
    rows = [timed_row(p, batch, context, props.multi_processor_count, copy_gbs)
            for (batch, context), p in problems.items()]
    print_rows(rows, copy_gbs)
    summary = {"copy_gbs": copy_gbs, "block_size": BLOCK_SIZE, "rows": rows}
    if not args.no_engine:
        del problems
        torch.cuda.empty_cache()
        summary["engine_like"] = engine_like(copy_gbs, args.max_model_len)
    write_summary("decode_attention", summary)


if __name__ == "__main__":
    main()
