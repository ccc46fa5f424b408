"""Question: is decode attention over an e4m3 cache faster when its Q K dot runs in e4m3
itself (q rounded to e4m3 with a scale per row, the FP8 MMA), so that only V is converted
to fp16, and what does that cost in accuracy?

The product's kernel (``minivllm/kernels/decode_attention.py``, its default for an FP8
cache in blocks of 64) converts every e4m3 value of K and V to fp16 before its dots. Here a
split kernel of whole tiles only (contexts a multiple of 64, so no masked tile) reads both
as tensor-memory boxes as the product does, in two variants of the same code:

- ``cvt``: K and V widened to fp16, q in fp16 (the product's arithmetic);
- ``qk8``: q divided by its row's amax / 448 and rounded to e4m3, the dot e4m3 x e4m3 with
  fp32 sums, the scores multiplied back by the row's scale; V widened to fp16 as before.
  With the 16 rows of a GQA group of 2 padded (``-64``: to 64 rows) triton picks the
  16-row MMA, which has no e4m3 form on sm_90, and widens both operands to fp16 anyway
  (the PTX generated for sm_90 holds ``mma.sync ... f16.f16`` and more conversions, not
  fewer); at 64 rows the warp-group MMA takes e4m3 (``wgmma ... m64n64k32 ... e4m3.e4m3``)
  and half the conversions are gone.

Both are checked against the float32 reference (their largest error and the error of the
output's rows relative to their size), then timed against each other and the product's
kernel in CUDA graphs, alternating, at offline-256's shape and long context::

    PYTHONPATH=. python3 lab/decode_fp8_qk.py                                   # on a GPU
    TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/decode_fp8_qk.py --check       # CPU: check only
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ab import alternating_medians
from minivllm.kernels._launch import LOG2E, cache_descriptor, next_pow2
from minivllm.kernels._softmax import normalize_rows, online_softmax_step
from minivllm.kernels.decode_attention import num_sms, choose_num_splits, decode_attention
from minivllm.kernels.merge_attention_splits import merge_attention_splits
from minivllm.kernels.reference import paged_attention_reference, quantize_kv_reference

E4M3_MAX = 448.0


@triton.jit
def _split_kernel(q_ptr, k_desc, v_desc, kv_lens_ptr, tables_ptr, part_out_ptr, part_lse_ptr, scale_log2,
                  num_splits, stride_qb, stride_qh, stride_bt,
                  NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, QK_FP8: tl.constexpr):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, kv_len)   # contexts hold whole tiles
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0).to(tl.float32)
    if QK_FP8:
        amax = tl.max(tl.abs(q), 1)
        row_scale = tl.where(amax > 0, amax / 448.0, 1.0)          # (BLOCK_G,)
        q_dot = (q / row_scale[:, None]).to(tl.float8e4nv)
    else:
        row_scale = tl.full([BLOCK_G], 1.0, tl.float32)
        q_dot = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table_row = tables_ptr + seq * stride_bt
    col = kv_head * HEAD_DIM
    block = tl.load(table_row + start // BLOCK_SIZE, mask=start < end, other=0)
    for n0 in range(start, end, BLOCK_N):
        row = block * BLOCK_SIZE + n0 % BLOCK_SIZE
        k = k_desc.load([row, col])
        v = v_desc.load([row, col])
        block = tl.load(table_row + (n0 + BLOCK_N) // BLOCK_SIZE, mask=n0 + BLOCK_N < end, other=0)
        if QK_FP8:
            s = tl.dot(q_dot, tl.trans(k)) * row_scale[:, None]
        else:
            s = tl.dot(q_dot, tl.trans(k.to(tl.float16)))
        m_i, l_i, acc = online_softmax_step(s, v.to(tl.float16), m_i, l_i, acc, scale_log2, "tf32", False)
    has_keys = l_i > 0
    out = normalize_rows(acc, l_i)
    row_out = (seq * NUM_HEADS + heads) * num_splits + split
    tl.store(part_out_ptr + row_out[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + row_out, lse, mask=head_ok)


def attention(q, k8, v8, kv_lens, tables, scale, qk_fp8: bool, block_n: int = 64, block_g: int = 16):
    """Whole-tile decode attention over e4m3 caches of scale 1 (no argument checks); ``block_g``
    rows per program (the GQA group padded): 16 gets the 16-row MMA, whose operands triton
    widens to fp16 even for e4m3 inputs; 64 the warp-group MMA, which takes e4m3 itself."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k8.shape
    splits = max(2, choose_num_splits(batch, num_kv_heads, tables.shape[1] * block_size, num_sms(q.device),
                                      block_n))
    part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    _split_kernel[(num_kv_heads, splits, batch)](
        q, cache_descriptor(k8, block_n), cache_descriptor(v8, block_n), kv_lens, tables, part_out, part_lse,
        scale * LOG2E, splits, q.stride(0), q.stride(1), tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(block_g, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, QK_FP8=qk_fp8, num_warps=4, num_stages=3)
    merge_attention_splits(part_out, part_lse, out)
    return out


def problem(batch: int, context: int, device: str, seed: int = 0):
    """Qwen3-0.6B's heads (16 / 8 of 128), scattered blocks of 64, e4m3 K/V of scale 1."""
    gen = torch.Generator(device).manual_seed(seed)
    width = context // 64
    shape = (batch * width, 64, 8, 128)
    one = torch.ones(1, device=device)
    k8, v8 = (quantize_kv_reference(torch.randn(shape, generator=gen, device=device), one) for _ in range(2))
    q = torch.randn(batch, 16, 128, generator=gen, device=device).bfloat16()
    tables = torch.randperm(batch * width, generator=gen, device=device).to(torch.int32).view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k8, v8, lens, tables, one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="check against the reference only (CPU interpreter)")
    args = ap.parse_args()
    device = "cpu" if args.check else "cuda"
    shapes = [(2, 128)] if args.check else [(8, 2048), (256, 1024), (128, 512), (16, 8192)]
    for batch, context in shapes:
        q, k8, v8, lens, tables, one = problem(batch, context, device)
        scale = 128 ** -0.5
        cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
        ref = paged_attention_reference(q.float(), k8, v8, cu, lens, tables, scale, one, one)
        fns = {"product": lambda _: decode_attention(q, k8, v8, lens, tables, scale, k_scale=one, v_scale=one),
               "cvt": lambda _: attention(q, k8, v8, lens, tables, scale, False),
               "qk8": lambda _: attention(q, k8, v8, lens, tables, scale, True),
               "cvt-64": lambda _: attention(q, k8, v8, lens, tables, scale, False, block_g=64),
               "qk8-64": lambda _: attention(q, k8, v8, lens, tables, scale, True, block_g=64)}
        for name, fn in fns.items():
            err = (fn(0).float() - ref)
            rel = (err.norm(dim=-1) / ref.norm(dim=-1)).mean()
            print(f"{batch} x {context} {name}: max |err| {err.abs().max():.2e}, mean row error / row {rel:.2e}",
                  flush=True)
        if not args.check:
            us = alternating_medians(fns, 1)
            kv = 2 * k8.numel()
            print(f"{batch} x {context}: " + ", ".join(f"{n} {t:.1f} us ({kv / t / 1e3:,.0f} GB/s)"
                                                       for n, t in us.items()), flush=True)


if __name__ == "__main__":
    main()
