"""Paged prefill attention against PyTorch SDPA on the GPU, in causal TFLOP/s.

    PYTHONPATH=. python3 -m benchmarks.prefill_attention [--quick] [--shapes 16x1024,...]
        [--block-size 64] [--timing graph|do_bench]

Qwen3-0.6B attention shapes (H 16, Hkv 8, D 128), bf16, blocks of the engine's CUDA
default, each sequence's blocks drawn at random from a pool 1.5x the need (unowned slots
NaN). Shapes: full causal prefills (16x1024, 4x4096, 1x8192), a prefix-cache hit
(4x1024+3072: 1024 new tokens over 3072 cached), short chunks over a long context
(32x64+960) and 16 prompts of 100..1024 tokens (varlen16, the offline-256 workload's).

Each call is replayed from a CUDA graph, as the engine's prefill graphs run it (host-side
launch work not counted; ``--timing do_bench``: eager calls after an L2 flush). FLOPs count
causal work only: 4 * H * D * q_len * (prefix + q_len / 2) per sequence. SDPA runs on
contiguous (B, H, S, D) copies with the K/V heads expanded (no row for the varlen batch);
"%SDPA" is against its default backend. Every config is checked against the float32
reference first; a failing one is reported and skipped. Each shape also times its default
config launched through a tile map, as the prefill graphs launch it
(``executor/prefill_graph.py``). ``*`` marks ``default_config``'s pick; ``--quick``: the
defaults and SDPA's default backend only.

Summary: ``$OUT/prefill_attention.json`` (``_bs<N>`` for another block size). Exit status 1
if a default config fails its check.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
import triton

from benchmarks.gpu_timing import graph_us
from benchmarks.report import write_summary
from minivllm.kernels.prefill_attention import (
    CONFIG_TABLE, PrefillConfig, TensorDescriptor, build_tile_map, default_config, prefill_attention, tile_rows,
)
from minivllm.kernels.reference import paged_attention_reference
from minivllm.llm import CUDA_BLOCK_SIZE

# Blocks as the engine makes them on CUDA (--block-size overrides).
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, CUDA_BLOCK_SIZE
DTYPE = torch.bfloat16
DEVICE = "cuda"   # a module constant so that a CPU dry run (TRITON_INTERPRET=1) can swap it
SCALE = HEAD_DIM ** -0.5
TIMING = "graph"   # --timing
GRAPH_CALLS = 5    # calls per captured graph: the replay's own launch spread over them
TOL = 1.6e-2   # bf16, as tests_gpu/test_kernels_gpu.py


@dataclass(frozen=True)
class Shape:
    """One prefill batch: new tokens per sequence over a common cached prefix."""

    name: str
    q_lens: tuple[int, ...]
    prefix: int = 0

    @property
    def flops(self) -> float:
        """Causal FLOPs of QK^T and PV: query i of a chunk sees prefix + i + 1 ~ prefix + q/2 keys."""
        return sum(4.0 * NUM_HEADS * HEAD_DIM * q * (self.prefix + q / 2) for q in self.q_lens)


def _varlen_shape(count: int, seed: int = 0) -> Shape:
    """``count`` full prompts of 100..1024 tokens, seeded."""
    rng = np.random.default_rng(seed)
    return Shape(f"varlen{count}", tuple(int(n) for n in rng.integers(100, 1025, count)))


SHAPES = [
    Shape("16x1024", (1024,) * 16),
    Shape("4x4096", (4096,) * 4),
    Shape("1x8192", (8192,)),
    Shape("4x1024+3072", (1024,) * 4, prefix=3072),
    Shape("32x64+960", (64,) * 32, prefix=960),
    _varlen_shape(16),
]

# m = block_m rows (tokens x GQA group 2), n = block_n keys, w = warps, s = stages. All
# compile for sm_90a without register spills (triton 3.9). ``io`` in a label: the Q tile
# and whole output tiles by tensor-memory copy (PrefillConfig.tma_io); ``perhead``: the q
# tiles of one (sequence, KV head) run side by side (their K/V shared in L2; heavy_first
# off), where ``heavy`` runs every sequence's longest tiles first.
CANDIDATES = [
    PrefillConfig(64, 64, 4, 3), PrefillConfig(64, 64, 4, 3, tma_io=False),
    PrefillConfig(64, 64, 4, 3, heavy_first=False), PrefillConfig(64, 64, 4, 3, heavy_first=False, tma_io=False),
    PrefillConfig(64, 64, 4, 4), PrefillConfig(64, 64, 4, 2, heavy_first=False),
    PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 64, 8, 3, heavy_first=False),
    PrefillConfig(128, 64, 8, 3, heavy_first=False, tma_io=False), PrefillConfig(128, 128, 8, 2, heavy_first=False),
    # The pointer path where the TMA path would run (block_size a multiple of block_n):
    PrefillConfig(64, 64, 4, 3, tma=False, tma_io=False), PrefillConfig(64, 64, 4, 3, tma=False),
]


def label(c: PrefillConfig) -> str:
    """Short name of a config, e.g. ``m64 n64 w4 s3 heavy tma io``: ``tma`` where its K/V
    tiles come by tensor-memory copy at this block size (``tma_allowed``), else ``ptr``;
    ``io`` where its Q and output tiles do (``tma_io``)."""
    tma = c.tma and BLOCK_SIZE % c.block_n == 0 and TensorDescriptor is not None
    return (f"m{c.block_m} n{c.block_n} w{c.num_warps} s{c.num_stages} {'heavy' if c.heavy_first else 'perhead'}"
            f" {'tma' if tma else 'ptr'}{' io' if c.tma_io and TensorDescriptor is not None else ''}")


@dataclass(frozen=True)
class Problem:
    """One shape's paged inputs, plus contiguous copies for SDPA (None for varlen batches)."""

    q: torch.Tensor               # (T, H, D)
    k_cache: torch.Tensor         # (N, bs, Hkv, D)
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor    # (B+1,) int32
    kv_lens: torch.Tensor         # (B,) int32
    block_tables: torch.Tensor    # (B, W) int32, -1 padded
    max_q_len: int
    sdpa_q: torch.Tensor | None   # (B, H, Lq, D)
    sdpa_k: torch.Tensor | None   # (B, H, Lk, D), K/V heads repeated to H
    sdpa_v: torch.Tensor | None


def make_problem(shape: Shape, seed: int = 0) -> Problem:
    """Random q/K/V; K/V scattered into the paged cache through random block tables."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    q_lens = torch.tensor(shape.q_lens, device=DEVICE)
    kv_lens = q_lens + shape.prefix
    need = (kv_lens + BLOCK_SIZE - 1) // BLOCK_SIZE
    pool = int(1.5 * int(need.sum())) + 1
    width = -(-int(need.max()) // 16) * 16   # a multiple of 16: one Triton specialisation for every shape
    owned = torch.arange(width, device=DEVICE)[None, :] < need[:, None]
    tables = torch.full((len(shape.q_lens), width), -1, dtype=torch.int32, device=DEVICE)
    tables[owned] = torch.randperm(pool, generator=gen, device=DEVICE)[: int(need.sum())].to(torch.int32)
    seq = torch.repeat_interleave(torch.arange(len(shape.q_lens), device=DEVICE), kv_lens)
    pos = torch.arange(int(kv_lens.sum()), device=DEVICE) - (torch.cumsum(kv_lens, 0) - kv_lens)[seq]
    slots = tables[seq, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    k, v = (torch.randn(len(slots), NUM_KV_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
            for _ in range(2))
    caches = []
    for src in (k, v):
        cache = torch.full((pool, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=DTYPE, device=DEVICE)
        cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots] = src
        caches.append(cache)
    q = torch.randn(int(q_lens.sum()), NUM_HEADS, HEAD_DIM, generator=gen, device=DEVICE).to(DTYPE)
    cu = torch.zeros(len(shape.q_lens) + 1, dtype=torch.int32, device=DEVICE)
    cu[1:] = torch.cumsum(q_lens, 0)
    sdpa = (None, None, None)
    if len(set(shape.q_lens)) == 1:
        b, lq, lk, g = len(shape.q_lens), shape.q_lens[0], shape.q_lens[0] + shape.prefix, NUM_HEADS // NUM_KV_HEADS
        sdpa = (q.view(b, lq, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous(),
                *(t.view(b, lk, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(g, 1).contiguous()
                  for t in (k, v)))
    return Problem(q, caches[0], caches[1], cu, kv_lens.to(torch.int32), tables, max(shape.q_lens), *sdpa)


def sdpa_fn(p: Problem, shape: Shape, backend: object | None) -> Callable[[], torch.Tensor]:
    """SDPA on the contiguous copies; causal, lower-right aligned over a prefix. Output (T, H, D)."""
    from torch.nn.attention import sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(p.sdpa_q.shape[2], p.sdpa_k.shape[2]) if shape.prefix else None

    def run() -> torch.Tensor:
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(p.sdpa_q, p.sdpa_k, p.sdpa_v, attn_mask=mask,
                                                  is_causal=not shape.prefix, scale=SCALE)
    return run


def sdpa_as_tokens(out: torch.Tensor) -> torch.Tensor:
    """(B, H, Lq, D) -> (B * Lq, H, D), the paged kernel's row order."""
    return out.transpose(1, 2).reshape(-1, NUM_HEADS, HEAD_DIM)


def max_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs error vs the fp32 reference; raises AssertionError beyond the bf16 tolerance
    (elementwise 1.6e-2 abs + rel, and a relative norm error below half of it, as the GPU tests)."""
    if not torch.isfinite(out).all():
        raise AssertionError("output holds NaN/inf")
    diff = (out.float() - ref).abs()
    worst = (diff - TOL * ref.abs()).max().item()           # elementwise |d| <= atol + rtol |ref|
    rel = (diff.norm() / ref.norm().clamp_min(1e-12)).item()
    if not (worst <= TOL and rel < TOL / 2):
        raise AssertionError(f"differs from the reference: max abs {diff.max().item():.3e}, "
                             f"relative norm {rel:.3e}")
    return diff.max().item()


def time_ms(fn: Callable[[], object], quick: bool) -> float:
    """Median ms per call: replayed from a CUDA graph of ``GRAPH_CALLS`` calls (``--timing
    graph``, as the engine's prefill graphs run it: no host work between calls), or
    ``triton.testing.do_bench`` (``--timing do_bench``: L2 flushed before each call, and the
    call's host-side launch inside the timed span whenever it outlasts the flush)."""
    if TIMING == "graph":
        try:
            return graph_us(lambda _: fn(), GRAPH_CALLS, replays=10 if quick else 20) / 1e3
        except Exception as exc:  # noqa: BLE001 - a call that cannot be captured is timed eagerly, loudly
            print(f"   (graph capture failed, timed with do_bench: {type(exc).__name__}: {str(exc)[:80]})")
    return triton.testing.do_bench(fn, warmup=10, rep=30 if quick else 60, return_mode="median")


def bench_sdpa(p: Problem, shape: Shape, ref: torch.Tensor, quick: bool) -> list[dict]:
    """One row per SDPA backend (default first); a backend that cannot run this shape says why."""
    from torch.nn.attention import SDPBackend

    rows = []
    backends = [("default", None)] + ([] if quick else [
        ("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION)])
    for name, backend in backends:
        row: dict = {"name": f"sdpa {name}"}
        try:
            fn = sdpa_fn(p, shape, backend)
            row["max_err"] = max_error(sdpa_as_tokens(fn()), ref)
            row["ms"] = time_ms(fn, quick)
        except Exception as exc:  # noqa: BLE001 - not every backend supports every shape
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
        rows.append(row)
    return rows


def bench_config(p: Problem, ref: torch.Tensor, config: PrefillConfig, quick: bool, map_mode: bool = False) -> dict:
    """Check one config against the reference, then time it; errors are recorded, not raised.
    ``map_mode``: launched as the engine's prefill graphs launch it, through a tile map
    (``build_tile_map``, sized to the batch's tiles) instead of the grid."""
    row: dict = {"name": label(config) + (" map" if map_mode else ""), "config": asdict(config), "map": map_mode}
    tile_map = None
    if map_mode:
        q_lens = (p.cu_seqlens_q[1:] - p.cu_seqlens_q[:-1]).cpu().numpy()
        block_q = tile_rows(config, NUM_HEADS, NUM_KV_HEADS)
        tile_map = torch.from_numpy(build_tile_map(q_lens, block_q, int(-(-q_lens // block_q).sum()))).to(DEVICE)

    def fn() -> torch.Tensor:
        return prefill_attention(p.q, p.k_cache, p.v_cache, p.cu_seqlens_q, p.kv_lens, p.block_tables,
                                 SCALE, p.max_q_len, config=config, tile_map=tile_map)
    try:
        row["max_err"] = max_error(fn(), ref)
        row["ms"] = time_ms(fn, quick)
    except Exception as exc:  # noqa: BLE001 - a sweep reports a failing config and goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    return row


def bench_shape(shape: Shape, configs: list[PrefillConfig], quick: bool) -> dict:
    """Reference, SDPA rows and config rows of one shape, with TFLOP/s and % of default SDPA."""
    p = make_problem(shape)
    ref = paged_attention_reference(p.q.float(), p.k_cache.float(), p.v_cache.float(), p.cu_seqlens_q,
                                    p.kv_lens, p.block_tables, SCALE)
    default = default_config(DTYPE, HEAD_DIM, p.max_q_len)
    sdpa = bench_sdpa(p, shape, ref, quick) if p.sdpa_q is not None else []
    rows = [bench_config(p, ref, c, quick) for c in configs] + [bench_config(p, ref, default, quick, map_mode=True)]
    base = sdpa[0].get("ms") if sdpa else None
    for row in sdpa + rows:
        if "ms" in row:
            row["tflops"] = shape.flops / (row["ms"] * 1e-3) / 1e12
            row["pct_sdpa"] = 100 * base / row["ms"] if base else None
        row["default"] = row.get("config") == asdict(default) and not row.get("map")
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    return {"shape": shape.name, "q_lens": list(shape.q_lens), "prefix": shape.prefix, "flops": shape.flops,
            "default": label(default), "sdpa": sdpa, "configs": rows, "best": best and best["name"]}


def print_shape(result: dict) -> None:
    """The shape's table: config, ms, TFLOP/s, % of default SDPA, max error."""
    print(f"\n== {result['shape']}: prefix {result['prefix']}, {result['flops'] / 1e9:.1f} causal GFLOP; "
          f"default config {result['default']} (*) ==")
    print(f"   {'config':<26} {'ms':>8} {'TFLOP/s':>8} {'%SDPA':>6} {'max err':>8}")
    for row in result["sdpa"] + result["configs"]:
        mark = "*" if row["default"] else " "
        if "error" in row:
            print(f" {mark} {row['name']:<26} {row['error']}")
            continue
        pct = f"{row['pct_sdpa']:5.1f}%" if row.get("pct_sdpa") is not None else "     -"
        print(f" {mark} {row['name']:<26} {row['ms']:>8.3f} {row['tflops']:>8.1f} {pct:>6} {row['max_err']:>8.1e}")
    sys.stdout.flush()


def summarize(results: list[dict]) -> bool:
    """Print defaults and best config per shape; False if some default config failed."""
    print("\nper shape: default config -> best config (TFLOP/s, % of default SDPA)")
    ok = True
    for r in results:
        rows = {row["name"]: row for row in r["configs"]}
        d, b = rows.get(r["default"], {}), rows.get(r["best"], {})
        ok = ok and "error" not in d
        print(f"  {r['shape']:<12} default {_brief(d)}  ->  best {_brief(b)}")
    return ok


def _brief(row: dict) -> str:
    """``name (TFLOP/s, % of SDPA)`` of a timed row, or why it has no time."""
    if "ms" not in row:
        return f"{row.get('name', '-')} FAILED: {row.get('error', 'not run')}"
    pct = f", {row['pct_sdpa']:.0f}% of SDPA" if row.get("pct_sdpa") is not None else ""
    return f"{row['name']} ({row['tflops']:.0f} TFLOP/s{pct})"


def _distinct(configs: list[PrefillConfig]) -> list[PrefillConfig]:
    """The first config of each label: where TMA cannot run, tma=True and tma=False are one kernel."""
    seen: dict[str, PrefillConfig] = {}
    for c in configs:
        seen.setdefault(label(c), c)
    return list(seen.values())


def main() -> None:
    global BLOCK_SIZE, TIMING
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="time only the default configs and SDPA's default")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                    help="tokens per KV cache block (the engine's CacheConfig.block_size)")
    ap.add_argument("--shapes", default=",".join(s.name for s in SHAPES),
                    help="comma list of shape names (default: all)")
    ap.add_argument("--timing", choices=("graph", "do_bench"), default=TIMING,
                    help="graph: replays of a captured CUDA graph (default); do_bench: triton's, eager")
    args = ap.parse_args()
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = set(names) - {s.name for s in SHAPES}
    if unknown:
        ap.error(f"--shapes: unknown {sorted(unknown)}; known: {[s.name for s in SHAPES]}")
    BLOCK_SIZE, TIMING = args.block_size, args.timing
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.prefill_attention needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    print(f"prefill attention, bf16, H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE}, "
          f"timing {TIMING}")
    print("default_config table (minivllm/kernels/prefill_attention.py CONFIG_TABLE; first match wins):")
    for fp32, max_dim, min_q, config in CONFIG_TABLE:
        print(f"  {'fp32' if fp32 else '16-bit'} head_dim <= {max_dim} max_q_len >= {min_q}: {label(config)}")
    results = []
    for shape in (s for s in SHAPES if s.name in names):
        default = default_config(DTYPE, HEAD_DIM, max(shape.q_lens))
        # One run per label: where TMA cannot run, tma=True and tma=False are the same kernel.
        configs = [default] if args.quick else _distinct([default, *CANDIDATES])
        results.append(bench_shape(shape, configs, args.quick))
        print_shape(results[-1])
        torch.cuda.empty_cache()
    ok = summarize(results)
    name = "prefill_attention" + ("" if BLOCK_SIZE == CUDA_BLOCK_SIZE else f"_bs{BLOCK_SIZE}")
    write_summary(name, {"block_size": BLOCK_SIZE, "timing": TIMING, "results": results})
    if not ok:
        raise SystemExit("a default config failed its check (see above)")


if __name__ == "__main__":
    main()
