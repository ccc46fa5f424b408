"""Question: does paged decode attention get faster when a whole tile looks up its KV
blocks once (one table load per block it spans) instead of once per token?

The product's kernel (``minivllm/kernels/decode_attention.py``) loads, for every token of a
tile, its block id from the table and forms a 64-bit address per token. A tile starts at a
multiple of BLOCK_N, so it lies inside one block (BLOCK_N <= block_size) or covers
BLOCK_N / block_size whole blocks: one scalar table load per block gives every address as
``block * stride + offset``. Only the whole, unmasked tiles change; a split's partial last
tile keeps the per-token lookup. (Spreading the blocks' ids over the rows by a reshape of
(blocks, block_size) kept the compiler from pipelining the K/V loads: in the sm_90 code
generated on the CPU by triton 3.6 no ``cp.async`` was left; ``tl.where`` per block keeps them.)

This file is the product's split kernel with that one change (``_attend_whole_tile``), its
launch, and an A/B against the product's kernel at the shape of ``benchmarks.fp8 --parts
attention`` (16 x 8,192 tokens, Qwen3-0.6B heads, block size 64), bf16 and e4m3 caches,
each checked against the torch reference first::

    PYTHONPATH=. python3 lab/decode_block_lookup.py            # on a GPU: graph us, A then B
    TRITON_INTERPRET=1 PYTHONPATH=. python3 lab/decode_block_lookup.py --check   # CPU: check only
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ab import alternating_medians
from minivllm.kernels._launch import LOG2E, next_pow2, upcast_dot
from minivllm.kernels._softmax import fold_kv_tile, normalize_rows
from minivllm.kernels.decode_attention import (
    _attend_tile, num_sms, choose_num_splits, decode_attention, default_config,
)
from minivllm.kernels.fp8 import is_fp8_cache
from minivllm.kernels.merge_attention_splits import merge_attention_splits
from minivllm.kernels.reference import paged_attention_reference, quantize_kv_reference


@triton.jit
def _attend_whole_tile(q, m_i, l_i, acc, n0, end, table_row, k_cache_ptr, v_cache_ptr, kv_head,
                       stride_cn, stride_cb, stride_ch, scale_log2, offs_n, offs_d, dtype,
                       BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr):
    """A whole tile from ``n0`` (a multiple of BLOCK_N): its blocks looked up once each."""
    if BLOCK_N <= BLOCK_SIZE:
        block = tl.load(table_row + n0 // BLOCK_SIZE).to(tl.int64)
        kv_off = block * stride_cn + (n0 % BLOCK_SIZE + offs_n) * stride_cb + kv_head * stride_ch
    else:  # BLOCK_N // BLOCK_SIZE whole blocks: one scalar lookup each, spread over its rows
        block = tl.zeros([BLOCK_N], tl.int64)
        for j in tl.static_range(BLOCK_N // BLOCK_SIZE):
            block = tl.where(offs_n // BLOCK_SIZE == j, tl.load(table_row + n0 // BLOCK_SIZE + j).to(tl.int64), block)
        kv_off = block * stride_cn + (offs_n % BLOCK_SIZE) * stride_cb + kv_head * stride_ch
    k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :])
    v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :])
    last = tl.full([q.shape[0]], end - 1, tl.int32)
    return fold_kv_tile(q, k, v, n0 + offs_n, last, m_i, l_i, acc, scale_log2, False, DOT_PRECISION,
                        UPCAST_DOT, KV_FP8, dtype)


@triton.jit
def _decode_split_kernel_b(
    q_ptr, k_cache_ptr, v_cache_ptr, kv_lens_ptr, block_tables_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    k_scale_ptr, v_scale_ptr, scale_log2, num_splits,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_cn, stride_cb, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    KV_FP8: tl.constexpr, FP16_DOTS: tl.constexpr,
):
    """The product's ``_decode_split_kernel`` with whole tiles through ``_attend_whole_tile``."""
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    seq = tl.program_id(2)
    kv_len = tl.load(kv_lens_ptr + seq)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_len, BLOCK_N), num_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, kv_len)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    head_ok = offs_g < GROUP
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_ok[:, None], other=0.0)
    dtype = q.dtype
    if FP16_DOTS:
        dtype = tl.float16
        q = q.to(dtype)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table_row = block_tables_ptr + seq * stride_bt
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_whole_tile(q, m_i, l_i, acc, n0, end, table_row, k_cache_ptr, v_cache_ptr,
                                           kv_head, stride_cn, stride_cb, stride_ch, scale_log2, offs_n, offs_d,
                                           dtype, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, UPCAST_DOT, KV_FP8)
    if full_end < end:
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, full_end, end, table_row, k_cache_ptr, v_cache_ptr, kv_head,
                                   stride_cn, stride_cb, stride_ch, scale_log2, offs_n, offs_d, dtype,
                                   BLOCK_SIZE, DOT_PRECISION, UPCAST_DOT, KV_FP8, True)
    has_keys = l_i > 0
    out = normalize_rows(acc, l_i)
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    if WRITE_FINAL:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        row = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=head_ok[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=head_ok)


def decode_attention_b(q, k_cache, v_cache, kv_lens, block_tables, scale, *, k_scale=None, v_scale=None):
    """``decode_attention`` (default config, no argument checks) through ``_decode_split_kernel_b``."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    fp8 = is_fp8_cache(k_cache)
    config = default_config(q.dtype, head_dim, fp8)
    num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * block_size, num_sms(q.device),
                                   config.block_n)
    out = torch.empty_like(q)
    part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    one = torch.ones(1, device=q.device)
    group = num_heads // num_kv_heads
    _decode_split_kernel_b[(num_kv_heads, num_splits, batch)](
        q, k_cache, v_cache, kv_lens, block_tables, out, part_out, part_lse,
        one if k_scale is None else k_scale, one if v_scale is None else v_scale,
        scale * LOG2E, num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=config.block_n, WRITE_FINAL=num_splits == 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST_DOT=upcast_dot(q),
        KV_FP8=fp8, FP16_DOTS=config.fp16_dots, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1:
        merge_attention_splits(part_out, part_lse, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="a small shape, checked only (CPU interpreter)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, context, block, heads, kv_heads, dim = (2, 300, 64, 4, 2, 64) if args.check else (16, 8192, 64, 16, 8, 128)
    gen = torch.Generator(device).manual_seed(0)
    width = triton.cdiv(context, block)
    shape = (batch * width, block, kv_heads, dim)
    q = torch.randn(batch, heads, dim, generator=gen, device=device).bfloat16()
    k, v = (torch.randn(shape, generator=gen, device=device).bfloat16() for _ in range(2))
    lens = torch.tensor([context - 7 * i for i in range(batch)], dtype=torch.int32, device=device)
    tables = torch.randperm(batch * width, generator=gen, device=device).to(torch.int32).view(batch, width)
    one = torch.ones(1, device=device)
    caches = {"bf16": (k, v, {}),
              "e4m3": (quantize_kv_reference(k, one), quantize_kv_reference(v, one), dict(k_scale=one, v_scale=one))}
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    for name, (kc, vc, scales) in caches.items():
        ref = paged_attention_reference(q, kc, vc, cu, lens, tables, dim ** -0.5, **scales).float()
        a = lambda _: decode_attention(q, kc, vc, lens, tables, dim ** -0.5, **scales)  # noqa: E731
        b = lambda _: decode_attention_b(q, kc, vc, lens, tables, dim ** -0.5, **scales)  # noqa: E731
        for label, fn in (("per token (product)", a), ("per block", b)):
            err = (fn(0).float() - ref).abs().max().item()
            assert err < 3e-2, f"{name} {label}: max error {err}"
        if args.check or device != "cuda":
            print(f"{name}: both kernels match the reference")
            continue
        us = alternating_medians({"per token": a, "per block": b}, calls=1)
        print(f"{name} cache, {batch} x {context:,}: per-token lookup {us['per token']:.1f} us, "
              f"per-block lookup {us['per block']:.1f} us (medians of 3, alternating)", flush=True)


if __name__ == "__main__":
    main()
