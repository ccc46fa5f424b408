"""Paged decode-attention bandwidth on the GPU, as a share of the measured copy bandwidth.

Qwen3-0.6B attention shapes (16 query heads, 8 KV heads, head_dim 128), bf16,
block_size 16, every sequence at the full context, blocks scattered at random
over the pool. Bytes counted are what the kernel must read or write at least:
K and V of every context token, q, the output, the block tables and kv_lens (the
split partials are overhead, not counted). Time: ``triton.testing.do_bench``
median (L2 flushed between runs) and the median of CUDA-graph replays. The copy
bandwidth is a 1 GiB device-to-device ``copy_``, counting bytes read + written.

    PYTHONPATH=. python3 -m benchmarks.decode_attention [--sweep]

``--sweep`` also times other tile configs and split counts (for tuning).

Measured on one H200 (triton 3.6, torch 2.11; copy 4221 GB/s), default config
(BLOCK_N 64, 4 warps, 3 stages), splits from ``choose_num_splits``:

    batch   ctx  splits   eager (do_bench)    CUDA graph
       64  1024       1   3530 GB/s  83.6%    4192 GB/s   99.3%
      256  1024       1   4251 GB/s 100.7%    4457 GB/s  105.6%
        8  8192       8   3367 GB/s  79.8%    4033 GB/s   95.6%

(Above 100%: a read-only stream beats a copy's mixed read + write.)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import triton

from minivllm.kernels.decode_attention import DecodeConfig, choose_num_splits, decode_attention, default_config
from minivllm.kernels.reference import paged_attention_reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
SHAPES = [(64, 1024), (256, 1024), (8, 8192)]          # (batch, context)
DTYPE = torch.bfloat16


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
    gen = torch.Generator("cuda").manual_seed(seed)
    width = context // BLOCK_SIZE
    num_blocks = batch * width
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return Problem(
        q=torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen, device="cuda").to(DTYPE),
        k_cache=torch.randn(shape, generator=gen, device="cuda").to(DTYPE),
        v_cache=torch.randn(shape, generator=gen, device="cuda").to(DTYPE),
        kv_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
        block_tables=torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32).view(batch, width),
    )


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written)."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def check(p: Problem, num_splits: int | None, config: DecodeConfig | None) -> float:
    """Max abs error vs the fp32 reference (raises if beyond the bf16 tolerance)."""
    out = decode_attention(p.q, p.k_cache, p.v_cache, p.kv_lens, p.block_tables, HEAD_DIM ** -0.5,
                           num_splits=num_splits, config=config)
    cu = torch.arange(p.q.shape[0] + 1, dtype=torch.int32, device="cuda")
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
    graph = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return eager * 1e3, graph * 1e3


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="also time other tile configs and split counts")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.decode_attention needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write)", flush=True)

    problems = {shape: make_problem(*shape) for shape in SHAPES}
    if args.sweep:
        sweep(problems, copy_gbs)
    rows = []
    for (batch, context), p in problems.items():
        err = check(p, None, None)
        eager, graph = time_us(p, None, None)
        splits = choose_num_splits(batch, NUM_KV_HEADS, context, props.multi_processor_count,
                                   default_config(DTYPE, HEAD_DIM).block_n)
        rows.append((batch, context, splits, p.bytes_moved, eager, graph, err))

    print(f"\ndecode attention, bf16, H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE}, "
          f"copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} {'MB':>7} {'eager us':>9} {'GB/s':>6} {'%copy':>6} "
          f"{'graph us':>9} {'GB/s':>6} {'%copy':>6} {'max err':>8}")
    for batch, context, splits, nbytes, eager, graph, err in rows:
        e_gbs, g_gbs = nbytes / (eager * 1e-6) / 1e9, nbytes / (graph * 1e-6) / 1e9
        print(f"{batch:>5} {context:>5} {splits:>6} {nbytes / 1e6:>7.1f} {eager:>9.1f} {e_gbs:>6.0f} "
              f"{100 * e_gbs / copy_gbs:>5.1f}% {graph:>9.1f} {g_gbs:>6.0f} {100 * g_gbs / copy_gbs:>5.1f}% "
              f"{err:>8.1e}")


if __name__ == "__main__":
    main()
