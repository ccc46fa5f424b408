"""The fused q/k norm + RoPE + K/V store kernel vs the path it replaces, on the GPU.

Old path (per layer, as ``Qwen3Attention.forward`` ran it): ``qk_norm_rope``
(torch.compile'd: about 6 kernels) on views of the packed QKV output, then the
``store_kv`` kernel. New: ``minivllm.kernels.qk_norm_rope_store`` (one kernel).
Qwen3-0.6B shapes (H 16, Hkv 8, D 128), bf16, block_size 16, slots scattered over
the pool, T in {1, 256, 8192} tokens. Outputs are checked against each other first.

Times, per call:
- ``do_bench``: ``triton.testing.do_bench`` median (L2 flushed between runs; at
  T=1 this is mostly launch overhead, host side included);
- ``graph``: one CUDA graph of 28 calls (one per layer, each its own cache layer,
  as a decode step replays them), replay time / 28: the device time a decode step pays.

    PYTHONPATH=. python3 -m benchmarks.qk_norm_rope_store [--smoke]

``--smoke``: tiny shapes on the CPU under TRITON_INTERPRET=1 (checks only, no timings).
Under 30 s on an H200 (most of it the first torch.compile).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import torch

from benchmarks.gpu_timing import graph_us

NUM_LAYERS = 28
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
MAX_POSITION, THETA, EPS = 40960, 1_000_000.0, 1e-6
TOKENS = (1, 256, 8192)


def make_inputs(t: int, device: str, dtype: torch.dtype, gen: torch.Generator,
                h: int = NUM_HEADS, hkv: int = NUM_KV_HEADS, d: int = HEAD_DIM) -> dict[str, torch.Tensor]:
    """One step's tensors: packed qkv (T, (H + 2 Hkv) D), weights, table, a (L, 2, N, bs, Hkv, D) cache."""
    from minivllm.layers.rotary import RotaryEmbedding

    n = -(-t // BLOCK_SIZE) * 2 + 2
    slots = torch.randperm(n * BLOCK_SIZE, generator=gen, device=device)[:t]
    return {
        "qkv": (torch.randn(t, (h + 2 * hkv) * d, generator=gen, device=device) * 3).to(dtype),
        "positions": torch.randint(0, MAX_POSITION, (t,), generator=gen, device=device),
        "q_weight": (1 + 0.5 * torch.randn(d, generator=gen, device=device)).to(dtype),
        "k_weight": (1 + 0.5 * torch.randn(d, generator=gen, device=device)).to(dtype),
        "cos_sin": RotaryEmbedding(d, MAX_POSITION, THETA).cos_sin_cache.to(device),
        "kv_cache": torch.zeros(NUM_LAYERS, 2, n, BLOCK_SIZE, hkv, d, dtype=dtype, device=device),
        "slots": slots,
    }


def old_path(x: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """What ``Qwen3Attention.forward`` ran before the fused kernel: returns q (T, H, D)."""
    from minivllm.kernels.store_kv import store_kv
    from minivllm.model.decoder import qk_norm_rope

    qkv, d, hkv = x["qkv"], x["q_weight"].shape[0], x["kv_cache"].shape[4]
    t, h = qkv.shape[0], qkv.shape[1] // d - 2 * hkv
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = qk_norm_rope(q.reshape(t, h, d), k.reshape(t, hkv, d), v.reshape(t, hkv, d), x["positions"],
                           x["q_weight"], x["k_weight"], EPS, x["cos_sin"])
    store_kv(k, v, x["kv_cache"][layer, 0], x["kv_cache"][layer, 1], x["slots"])
    return q


def new_path(x: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
    """The fused kernel: returns q (T, H, D), K/V stored."""
    from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store

    return qk_norm_rope_store(x["qkv"], x["positions"], x["q_weight"], x["k_weight"], EPS, x["cos_sin"],
                              x["kv_cache"][layer, 0], x["kv_cache"][layer, 1], x["slots"])


def check(x: dict[str, torch.Tensor]) -> float:
    """Old vs new on the same inputs: q and layer 0's caches; returns max |diff| (raises if off)."""
    q_old = old_path(x, 0)
    cache_old = x["kv_cache"][0].clone()
    x["kv_cache"][0].zero_()
    q_new = new_path(x, 0)
    cache_new = x["kv_cache"][0]
    if not torch.equal(cache_new[1], cache_old[1]):
        raise AssertionError("v cache differs")
    tol = 1e-5 if q_new.dtype == torch.float32 else 2 ** -4
    torch.testing.assert_close(q_new, q_old, atol=tol, rtol=tol)
    torch.testing.assert_close(cache_new, cache_old, atol=tol, rtol=tol)
    return max((q_new.float() - q_old.float()).abs().max().item(),
               (cache_new.float() - cache_old.float()).abs().max().item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, checks only")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"   # before the kernels are imported
        gen = torch.Generator().manual_seed(0)
        for t in (1, 5):
            for dtype in (torch.float32, torch.bfloat16):
                diff = check(make_inputs(t, "cpu", dtype, gen, h=4, hkv=2, d=16))
                print(f"smoke T={t} {str(dtype)[6:]}: old vs new max|diff| {diff:.2e}")
        return
    if not torch.cuda.is_available():
        sys.exit("needs a GPU (or --smoke)")
    import triton.testing

    gen = torch.Generator("cuda").manual_seed(0)
    t0 = time.perf_counter()
    print(f"Qwen3-0.6B shapes H {NUM_HEADS} Hkv {NUM_KV_HEADS} D {HEAD_DIM}, block_size {BLOCK_SIZE}; "
          f"{torch.cuda.get_device_name()}")
    print(f"{'dtype':>8} {'T':>6} {'max|diff|':>10} {'old do_bench':>13} {'new do_bench':>13} "
          f"{'old graph':>10} {'new graph':>10} {'speed-up':>9}   (us per layer)")
    for dtype in (torch.bfloat16, torch.float32):
        for t in TOKENS:
            x = make_inputs(t, "cuda", dtype, gen)
            diff = check(x)
            bench = {name: triton.testing.do_bench(lambda fn=fn: fn(x, 0), return_mode="median") * 1e3
                     for name, fn in (("old", old_path), ("new", new_path))}
            graph = {name: graph_us(lambda layer, fn=fn: fn(x, layer), NUM_LAYERS, replays=50)
                     for name, fn in (("old", old_path), ("new", new_path))}
            print(f"{str(dtype)[6:]:>8} {t:>6} {diff:>10.2e} {bench['old']:>13.2f} {bench['new']:>13.2f} "
                  f"{graph['old']:>10.2f} {graph['new']:>10.2f} {graph['old'] / graph['new']:>8.2f}x", flush=True)
    print(f"total {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
