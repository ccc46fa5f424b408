"""Triton kernels vs the torch references, on CPU under TRITON_INTERPRET=1.

Shapes are small (the interpreter runs each program in Python) but cover what
breaks paged kernels: blocks scattered over a larger pool, -1 padded block
tables, contexts of 0 and 1 tokens and not a multiple of the block size, short
and long sequences in one batch, GQA groups of 1, 2 and 3, block sizes 1..32.
Cache slots that no sequence owns hold NaN, so any read past a mask shows up.
Prefill also runs with explicit tile configs (the GPU defaults' 128-row tiles at
tiny head_dim) placed so that its unmasked/masked loop split meets its edge cases.

Tolerances (vs the reference in fp32 on the same low-precision inputs):
fp32 1e-5 abs + rel; fp16 2e-3; bf16 1.6e-2 (output rounding plus P cast to the
cache dtype before P @ V, as on the GPU).
"""

from __future__ import annotations

import dataclasses
import os

# Must precede the first triton import of this process (tests/conftest.py sets it
# too, for every pytest worker); on this CPU-only machine kernels cannot run otherwise.
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm.kernels.decode_attention import (  # noqa: E402
    MAX_SPLITS, TARGET_PROGRAMS_PER_SM, DecodeConfig, choose_num_splits, decode_attention,
)
from minivllm.kernels._launch import tma_allowed  # noqa: E402
from minivllm.kernels.merge_attention_splits import (  # noqa: E402
    merge_attention_splits, merge_attention_splits_reference,
)
from minivllm.kernels.prefill_attention import PrefillConfig, default_config, prefill_attention  # noqa: E402
from minivllm.kernels.reference import paged_attention_reference, store_kv_reference  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_paged_kv(
    kv_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    gen: torch.Generator, extra_width: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches, blocks scattered over a pool 3x the need; unowned slots are NaN.

    Returns k_cache, v_cache (N, bs, Hkv, D) and block_tables (B, W) int32 padded with -1.
    """
    need = [-(-n // block_size) for n in kv_lens]
    num_blocks = 3 * sum(need) + 2
    width = max(need, default=0) + extra_width
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.full((len(kv_lens), width), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for b, (n, nb) in enumerate(zip(kv_lens, need)):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
        for pos in range(n):
            blk, off = tables[b, pos // block_size].item(), pos % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, tables


def reference_fp32(q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables, scale) -> torch.Tensor:
    """The torch reference on the same (possibly low-precision) inputs, computed and returned in fp32."""
    return paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu_seqlens_q, kv_lens,
                                     block_tables, scale)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Every element finite and within the dtype's tolerance of the fp32 reference."""
    assert torch.isfinite(out).all(), "kernel output holds NaN/inf"
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# ----------------------------------------------------------------------------- decode

DECODE_CASES = [
    # (dtype, block_size, num_heads, num_kv_heads, head_dim, kv_lens)
    (torch.float32, 4, 4, 2, 32, [0, 1, 7, 70, 16]),
    (torch.float32, 1, 2, 2, 16, [3, 1, 40]),
    (torch.float32, 32, 6, 2, 16, [33, 0, 5]),       # GQA group of 3 (padded to 16 rows)
    (torch.float16, 16, 4, 1, 64, [1, 90, 17]),
    (torch.bfloat16, 8, 4, 2, 32, [0, 9, 64, 2]),
    # head_dim 64 at the GQA groups of Qwen2.5-0.5B (14/2, a group of 7) and Llama-3.2-1B
    # (32/8, a group of 4; here 8/2)
    (torch.bfloat16, 16, 14, 2, 64, [1, 33, 70]),
    (torch.float32, 16, 8, 2, 64, [5, 40]),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"{str(c[0])[6:]}-bs{c[1]}-h{c[2]}/{c[3]}-d{c[4]}")
def test_decode_attention_matches_reference(case) -> None:
    dtype, bs, h, hkv, d, lens = case
    gen = torch.Generator().manual_seed(len(lens) * 100 + bs)
    k_cache, v_cache, tables = make_paged_kv(lens, bs, hkv, d, dtype, gen)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), h, d, generator=gen).to(dtype)
    scale = d ** -0.5
    ref = reference_fp32(q, k_cache, v_cache, torch.arange(len(lens) + 1, dtype=torch.int32), kv_lens, tables, scale)
    # None: the heuristic, one split on CPU (direct write, no merge). 3 and 5: uneven shares,
    # and empty splits for short rows. block_n 16: several tiles per split, tiles spanning blocks.
    for num_splits, config in ((None, None), (3, None), (3, DecodeConfig(block_n=16)),
                               (5, DecodeConfig(block_n=16))):
        out = decode_attention(q, k_cache, v_cache, kv_lens, tables, scale, num_splits=num_splits, config=config)
        assert out.shape == q.shape and out.dtype == dtype
        assert_close(out, ref, dtype)
        assert (out[kv_lens == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_whole_tiles_by_box_and_by_pointer(dtype) -> None:
    """Blocks of 32 hold whole tiles of 16 or 32: those come as tensor-memory boxes, the
    split's partial last tile by pointers; the same answers as pointers throughout."""
    gen = torch.Generator().manual_seed(13)
    lens = [0, 1, 31, 32, 70, 129]
    k_cache, v_cache, tables = make_paged_kv(lens, 32, 2, 16, dtype, gen)
    assert tma_allowed(k_cache, 16) and tma_allowed(k_cache, 32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 4, 16, generator=gen).to(dtype)
    ref = reference_fp32(q, k_cache, v_cache, torch.arange(len(lens) + 1, dtype=torch.int32), kv_lens, tables, 0.25)
    for num_splits, block_n in ((1, 32), (3, 16), (3, 32)):
        outs = [decode_attention(q, k_cache, v_cache, kv_lens, tables, 0.25, num_splits=num_splits,
                                 config=DecodeConfig(block_n=block_n, tma=tma)) for tma in (True, False)]
        for out in outs:
            assert_close(out, ref, dtype)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_decode_attention_strided_q() -> None:
    """q as a strided slice of a packed projection (the model's layout)."""
    gen = torch.Generator().manual_seed(7)
    lens = [5, 30]
    k_cache, v_cache, tables = make_paged_kv(lens, 4, 2, 16, torch.float32, gen)
    packed = torch.randn(2, 4 + 2 * 2, 16, generator=gen)
    q = packed[:, :4]
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    ref = reference_fp32(q, k_cache, v_cache, torch.arange(3, dtype=torch.int32), kv_lens, tables, 0.25)
    assert_close(decode_attention(q, k_cache, v_cache, kv_lens, tables, 0.25, num_splits=2), ref, torch.float32)


def test_choose_num_splits_depends_on_shapes_only() -> None:
    # Many (sequence, head) programs already fill the GPU: no split.
    assert choose_num_splits(256, 8, 1024, 132, 64) == 1
    assert choose_num_splits(64, 8, 1024, 132, 64) == 1
    # Batch 8 x 8 KV heads on 132 SMs: split until the SMs have their target of programs.
    s = choose_num_splits(8, 8, 8192, 132, 64)
    assert 8 * 8 * s >= TARGET_PROGRAMS_PER_SM * 132 and s <= MAX_SPLITS
    # Never more splits than tiles of the longest context the block table can hold.
    assert choose_num_splits(1, 1, 16, 132, 64) == 1
    assert choose_num_splits(1, 1, 10**6, 132, 64) == MAX_SPLITS
    assert choose_num_splits(4, 2, 0, 1, 64) == 1


def test_merge_attention_splits_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    part_out = torch.randn(3, 2, 5, 16, generator=gen)
    part_lse = torch.randn(3, 2, 5, generator=gen) * 4
    part_lse[0, 1, [1, 3]] = float("-inf")   # empty splits
    part_lse[2, 0] = float("-inf")           # a padding row: every split empty
    out = torch.empty(3, 2, 16)
    merge_attention_splits(part_out, part_lse, out)
    ref = merge_attention_splits_reference(part_out, part_lse)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert (out[2, 0] == 0).all()
    again = torch.empty(3, 2, 16)
    merge_attention_splits(part_out, part_lse, again, pdl=True)  # off a GPU: the plain launch
    assert torch.equal(again, out)


def test_decode_attention_forwards_pdl_to_its_merge(monkeypatch) -> None:
    """``pdl`` reaches the merge of the splits (the one launch of decode attention that lets
    the next kernel start early); one split has no merge. Harmless on the CPU."""
    import minivllm.kernels.decode_attention as da

    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, tables = make_paged_kv([9, 30], 4, 2, 16, torch.float32, gen)
    kv_lens = torch.tensor([9, 30], dtype=torch.int32)
    q = torch.randn(2, 4, 16, generator=gen)
    seen = []
    real = da.merge_attention_splits
    monkeypatch.setattr(da, "merge_attention_splits", lambda *a, pdl: (seen.append(pdl), real(*a, pdl=pdl))[1])
    plain = decode_attention(q, k_cache, v_cache, kv_lens, tables, 0.25, num_splits=2)
    assert torch.equal(decode_attention(q, k_cache, v_cache, kv_lens, tables, 0.25, num_splits=2, pdl=True), plain)
    decode_attention(q, k_cache, v_cache, kv_lens, tables, 0.25, num_splits=1, pdl=True)
    assert seen == [False, True]


def test_decode_attention_rejects_bad_arguments() -> None:
    q = torch.randn(2, 4, 16)
    cache = torch.zeros(5, 4, 2, 16)
    lens = torch.tensor([1, 2], dtype=torch.int32)
    tables = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(TypeError, match="k_cache"):
        decode_attention(q, cache.half(), cache, lens, tables, 1.0)
    with pytest.raises(TypeError, match="kv_lens"):
        decode_attention(q, cache, cache, lens.long(), tables, 1.0)
    with pytest.raises(ValueError, match="H % Hkv"):
        decode_attention(torch.randn(2, 3, 16), cache, cache, lens, tables, 1.0)
    with pytest.raises(ValueError, match="block_size"):
        decode_attention(q, torch.zeros(5, 3, 2, 16), torch.zeros(5, 3, 2, 16), lens, tables, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention(torch.randn(2, 4, 24), torch.zeros(5, 4, 2, 24), torch.zeros(5, 4, 2, 24), lens, tables, 1.0)
    with pytest.raises(ValueError, match="kv_lens"):
        decode_attention(q, cache, cache, lens[:1], tables, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q, cache, cache, lens, tables, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="scale"):
        decode_attention(q, cache, cache, lens, tables, 0.0)
    with pytest.raises(TypeError, match="config"):
        decode_attention(q, cache, cache, lens, tables, 1.0, config=PrefillConfig())


# ----------------------------------------------------------------------------- prefill

PREFILL_CASES = [
    # (dtype, block_size, num_heads, num_kv_heads, head_dim, [(q_len, kv_len), ...])
    # full prefill, prefix-cache hit / later chunk, single token, empty sequence, q_len 0 with a context
    (torch.float32, 4, 4, 2, 32, [(13, 13), (5, 37), (1, 9), (0, 0), (0, 6)]),
    (torch.float32, 1, 2, 2, 16, [(3, 3), (7, 20)]),
    (torch.float32, 16, 6, 2, 16, [(40, 40), (22, 50)]),   # group of 3: 21 tokens per 64-row tile
    (torch.float16, 8, 4, 1, 64, [(20, 20), (9, 30)]),
    (torch.bfloat16, 4, 4, 2, 32, [(11, 11), (6, 19), (1, 1)]),
    # head_dim 64 at the Qwen2.5-0.5B (group of 7) and Llama-3.2-1B (group of 4) groupings
    (torch.bfloat16, 16, 14, 2, 64, [(30, 30), (9, 41)]),
    (torch.float32, 16, 8, 2, 64, [(17, 17), (5, 30)]),
]


def run_prefill_case(dtype: torch.dtype, bs: int, h: int, hkv: int, d: int, seqs: list[tuple[int, int]],
                     config: PrefillConfig | None, lead_rows: int = 0, tail_rows: int = 2) -> None:
    """Prefill over (q_len, kv_len) sequences vs the reference; ``lead_rows`` before cu_seqlens_q[0]
    and ``tail_rows`` past cu_seqlens_q[-1] belong to no sequence and must come out zero."""
    gen = torch.Generator().manual_seed(len(seqs) * 10 + bs + h)
    q_lens = [ql for ql, _ in seqs]
    lens = [kl for _, kl in seqs]
    k_cache, v_cache, tables = make_paged_kv(lens, bs, hkv, d, dtype, gen)
    cu = torch.tensor([lead_rows] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + tail_rows, h, d, generator=gen).to(dtype)
    scale = d ** -0.5
    ref = reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, scale)
    # max_q_len larger than needed: the extra tiles must do nothing.
    out = prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, scale, max(q_lens, default=0) + 5,
                            config=config)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, ref, dtype)
    assert (out[:lead_rows] == 0).all() and (out[int(cu[-1]):] == 0).all()


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"{str(c[0])[6:]}-bs{c[1]}-h{c[2]}/{c[3]}-d{c[4]}")
def test_prefill_attention_matches_reference(case) -> None:
    run_prefill_case(*case, config=None)


# Explicit tile configs at small shapes: the unmasked/masked loop split and the grid orders.
# With GQA group G a tile holds BLOCK_Q = block_m / G tokens; the unmasked loop ends at
# full_end = (prefix + first token + 1) rounded down to block_n, the masked one at the
# tile's last position.
PREFILL_CONFIG_CASES = [
    # (dtype, block_size, H, Hkv, D, [(q_len, kv_len)], config)
    # 128 rows = 64 tokens x G 2 (the GPU default's shape): q_len 70 leaves a 6-token tile;
    # prefix 35 is no multiple of block_n; q_len 1 in a prefill batch; empty rows.
    (torch.float32, 4, 4, 2, 16, [(70, 70), (5, 40), (1, 9), (0, 0), (0, 6), (64, 64)],
     PrefillConfig(128, 16, 8, 3)),
    (torch.bfloat16, 4, 4, 2, 16, [(70, 70), (5, 40), (1, 9), (0, 6)], PrefillConfig(128, 16, 8, 3)),
    # 16-token tiles, block_n 16: prefix 31 puts the first position + 1 exactly on a tile edge
    # (row 0 sees none of the first masked tile); prefix 16 = one whole unmasked tile; q_len 33.
    (torch.float32, 8, 4, 2, 16, [(16, 47), (33, 49), (1, 1), (17, 33)],
     PrefillConfig(32, 16, 4, 1, heavy_first=False)),
    (torch.float16, 8, 4, 2, 32, [(16, 47), (33, 49), (1, 1)], PrefillConfig(32, 16, 4, 2)),
    # G 3: 64 rows = 21 tokens + 1 padding row; block_size 32 > block_n 16 (a tile inside one block).
    (torch.float32, 32, 6, 2, 16, [(40, 40), (22, 50), (0, 0)], PrefillConfig(64, 16, 4, 2)),
    # G 1 and block_size 1: every key its own block.
    (torch.float32, 1, 2, 2, 16, [(20, 20), (7, 26)], PrefillConfig(16, 32, 4, 2, heavy_first=False)),
]


@pytest.mark.parametrize("case", PREFILL_CONFIG_CASES,
                         ids=lambda c: f"{str(c[0])[6:]}-bs{c[1]}-h{c[2]}/{c[3]}-m{c[6].block_m}n{c[6].block_n}")
def test_prefill_attention_configs_match_reference(case) -> None:
    *shape, config = case
    run_prefill_case(*shape, config=config)


# The TMA path (unmasked tiles as boxes of the cache seen as rows): blocks of 32 and 64
# tokens holding 2-4 tiles of 16; prefixes off the tile and block edges; unowned slots NaN,
# so a box that strayed past a sequence's keys would poison its rows.
PREFILL_TMA_CASES = [
    (torch.float32, 32, 4, 2, 16, [(70, 70), (5, 40), (1, 9), (0, 6), (40, 107)], PrefillConfig(32, 16, 4, 2)),
    (torch.float16, 64, 4, 2, 32, [(33, 49), (16, 47), (1, 1), (90, 90)], PrefillConfig(64, 16, 4, 3)),
    (torch.bfloat16, 32, 6, 2, 16, [(40, 40), (22, 50), (0, 0)], PrefillConfig(64, 32, 4, 2)),
]


@pytest.mark.parametrize("case", PREFILL_TMA_CASES, ids=lambda c: f"{str(c[0])[6:]}-bs{c[1]}-n{c[6].block_n}")
def test_prefill_attention_tma_path_matches_reference_and_pointer_path(case) -> None:
    """Both load paths against the reference, and against each other bit for bit (the same
    arithmetic in the same order; only how the tiles arrive differs)."""
    *shape, config = case
    dtype, bs, h, hkv, d, seqs = shape
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, tables = make_paged_kv([kl for _, kl in seqs], bs, hkv, d, dtype, gen)
    assert tma_allowed(k_cache, config.block_n)
    cu = torch.tensor([0] + [ql for ql, _ in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_lens = torch.tensor([kl for _, kl in seqs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=gen).to(dtype)
    args = (q, k_cache, v_cache, cu, kv_lens, tables, d ** -0.5, max(ql for ql, _ in seqs))
    with_tma = prefill_attention(*args, config=config)
    without = prefill_attention(*args, config=dataclasses.replace(config, tma=False, tma_io=False))
    assert_close(with_tma, reference_fp32(*args[:7]), dtype)
    assert torch.equal(with_tma, without)


def test_prefill_attention_q_as_a_view_of_qkv() -> None:
    """q as the model passes it, the first H heads of each token's packed (H + 2 Hkv) qkv row:
    its tile comes as one box of that strided view (``tma_io``), with the same bits as a
    contiguous copy; a q whose rows are not 16-byte aligned takes pointer loads."""
    from minivllm.kernels.prefill_attention import tma_io_allowed
    gen = torch.Generator().manual_seed(3)
    seqs = [(20, 20), (9, 41)]
    k_cache, v_cache, tables = make_paged_kv([kl for _, kl in seqs], 32, 2, 16, torch.bfloat16, gen)
    cu = torch.tensor([0, 20, 29], dtype=torch.int32)
    kv_lens = torch.tensor([kl for _, kl in seqs], dtype=torch.int32)
    qkv = torch.randn(29, 4 + 2 * 2, 16, generator=gen).to(torch.bfloat16)
    q = qkv[:, :4]
    assert not q.is_contiguous() and tma_io_allowed(q)
    config = PrefillConfig(32, 16, 4, 2)
    args = (k_cache, v_cache, cu, kv_lens, tables, 16 ** -0.5, 20)
    out = prefill_attention(q, *args, config=config)
    assert torch.equal(out, prefill_attention(q.contiguous(), *args, config=config))
    assert_close(out, reference_fp32(q, *args[:6]), torch.bfloat16)
    assert not tma_io_allowed(torch.zeros(29 * 4 * 16 + 1, dtype=torch.bfloat16)[1:].view(29, 4, 16))


def test_prefill_attention_tma_allowed_only_where_a_box_fits() -> None:
    cache = torch.zeros(4, 32, 2, 16)
    assert tma_allowed(cache, 16) and tma_allowed(cache, 32)
    assert not tma_allowed(cache, 64)                      # a tile would span two blocks
    assert not tma_allowed(cache[:, :, :1], 16)            # not one contiguous (N*bs, Hkv*D) array
    assert not tma_allowed(torch.zeros(4, 32, 1, 2), 16)   # rows of 4 bytes: not 16-byte aligned
    with pytest.raises(ValueError, match="tma"):
        PrefillConfig(tma=1)


def test_prefill_attention_zeroes_rows_of_no_sequence() -> None:
    """Rows before cu_seqlens_q[0] and after cu_seqlens_q[-1] (the output is torch.empty and
    the kernel's extra programs zero them, also when there are more such rows than tiles)."""
    cfg = PrefillConfig(16, 16, 4, 1)
    run_prefill_case(torch.float32, 4, 4, 2, 16, [(3, 3), (2, 7)], cfg, lead_rows=21, tail_rows=45)
    q = torch.randn(9, 4, 16)
    empty = torch.zeros(0, dtype=torch.int32)
    out = prefill_attention(q, torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16), torch.zeros(1, dtype=torch.int32),
                            empty, empty.view(0, 1), 0.25, 0, config=cfg)
    assert (out == 0).all()


@pytest.mark.parametrize("case", PREFILL_CONFIG_CASES[:4] + PREFILL_CASES[2:3],
                         ids=lambda c: f"{str(c[0])[6:]}-h{c[2]}/{c[3]}-{len(c[5])}seqs")
def test_prefill_attention_tile_map_equals_the_grid(case) -> None:
    """Map mode (the grid fixed by the map's capacity, as a CUDA graph needs) computes the
    grid mode's output bit for bit, with idle map rows, and padding rows given a kv_len-0
    sequence of their own come out zero."""
    from minivllm.kernels.prefill_attention import build_tile_map, tile_rows

    dtype, bs, h, hkv, d, seqs, *rest = case
    config = rest[0] if rest else PrefillConfig(64, 16, 4, 2)
    gen = torch.Generator().manual_seed(7)
    seqs = list(seqs) + [(11, 0)]  # the padding rows: a sequence with no context
    q_lens, lens = [ql for ql, _ in seqs], [kl for _, kl in seqs]
    k_cache, v_cache, tables = make_paged_kv(lens, bs, hkv, d, dtype, gen)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h, d, generator=gen).to(dtype)
    scale = d ** -0.5
    grid_out = prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, scale, max(q_lens), config=config)
    block_q = tile_rows(config, h, hkv)
    tiles = sum(-(-n // block_q) for n in q_lens)
    tile_map = torch.from_numpy(build_tile_map(np.array(q_lens), block_q, tiles + 5))
    out = prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, scale, 0, config=config, tile_map=tile_map)
    assert torch.equal(out, grid_out)
    assert (out[int(cu[-2]):] == 0).all()
    assert_close(out, reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, scale), dtype)


def test_build_tile_map() -> None:
    from minivllm.kernels.prefill_attention import build_tile_map

    got = build_tile_map(np.array([5, 0, 9, 1]), 4, 8)
    # tiles: seq 0 -> 0, 1; seq 2 -> 0, 1, 2; seq 3 -> 0; the last tiles (most keys) first
    assert got.tolist() == [[2, 2], [0, 1], [2, 1], [0, 0], [2, 0], [3, 0], [-1, -1], [-1, -1]]
    assert got.dtype == np.int32
    with pytest.raises(ValueError, match="6 q tiles"):
        build_tile_map(np.array([5, 0, 9, 1]), 4, 5)
    q = torch.randn(4, 2, 16)
    args = (q, torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16), torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([4], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 0.25, 4)
    with pytest.raises(TypeError, match="tile_map"):
        prefill_attention(*args, tile_map=torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="tile_map"):
        prefill_attention(*args, tile_map=torch.zeros(6, dtype=torch.int32))


def test_prefill_default_configs() -> None:
    # The GPU shapes: 64 x 64 tiles, 4 warps for bf16/fp16 chunks of any length
    # (docs/tuning.md, "Prefill attention tiles").
    per_head = PrefillConfig(64, 64, 4, 3, heavy_first=False)     # chunks under 2,048 tokens
    assert default_config(torch.bfloat16, 128, 1024) == per_head == default_config(torch.bfloat16, 128, 16)
    assert default_config(torch.float16, 128, 4096) == PrefillConfig(64, 64, 4, 3)  # heavy first
    assert default_config(torch.float32, 128, 4096).block_m <= 32   # fp32: FMA dots, small tiles
    for dtype in DTYPES:
        for head_dim in (16, 64, 128, 256, 512):
            for max_q_len in (0, 1, 100, 10**5):
                assert isinstance(default_config(dtype, head_dim, max_q_len), PrefillConfig)
    with pytest.raises(ValueError, match="block_m"):
        PrefillConfig(block_m=8)
    with pytest.raises(ValueError, match="block_n"):
        PrefillConfig(block_n=48)
    with pytest.raises(ValueError, match="num_stages"):
        PrefillConfig(num_stages=0)


def test_chunked_prefill_equals_one_shot() -> None:
    """Prefill over 3 chunks, each chunk's K/V stored first (each chunk sees the earlier ones
    through the cache), gives the one-shot prefill's output, and decode agrees on the next token."""
    gen = torch.Generator().manual_seed(11)
    n, bs, h, hkv, d = 23, 4, 4, 2, 16
    table = torch.randperm(16, generator=gen)[: -(-(n + 1) // bs)].to(torch.int32)[None, :]
    keys = torch.randn(n + 1, hkv, d, generator=gen)
    values = torch.randn(n + 1, hkv, d, generator=gen)
    q = torch.randn(n + 1, h, d, generator=gen)
    slots = (table[0, torch.arange(n + 1) // bs] * bs + torch.arange(n + 1) % bs).long()
    k_cache = torch.full((16, bs, hkv, d), float("nan"))
    v_cache = torch.full((16, bs, hkv, d), float("nan"))

    chunks = []
    for lo, hi in ((0, 10), (10, 11), (11, n)):
        store_kv_reference(keys[lo:hi], values[lo:hi], k_cache, v_cache, slots[lo:hi])
        cu = torch.tensor([0, hi - lo], dtype=torch.int32)
        chunks.append(prefill_attention(q[lo:hi], k_cache, v_cache, cu, torch.tensor([hi], dtype=torch.int32),
                                        table, 0.25, hi - lo))
    one_shot = reference_fp32(q[:n], k_cache, v_cache, torch.tensor([0, n], dtype=torch.int32),
                              torch.tensor([n], dtype=torch.int32), table, 0.25)
    assert_close(torch.cat(chunks), one_shot, torch.float32)

    store_kv_reference(keys[n:], values[n:], k_cache, v_cache, slots[n:])
    lens = torch.tensor([n + 1], dtype=torch.int32)
    dec = decode_attention(q[n:], k_cache, v_cache, lens, table, 0.25, num_splits=2)
    pre = prefill_attention(q[n:], k_cache, v_cache, torch.tensor([0, 1], dtype=torch.int32), lens, table, 0.25, 1)
    torch.testing.assert_close(dec, pre, atol=1e-5, rtol=1e-5)


def test_prefill_attention_rejects_bad_arguments() -> None:
    q = torch.randn(5, 4, 16)
    cache = torch.zeros(5, 4, 2, 16)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    lens = torch.tensor([5], dtype=torch.int32)
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        prefill_attention(q, cache, cache, cu.long(), lens, tables, 1.0, 5)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        prefill_attention(q, cache, cache, cu[:1], lens, tables, 1.0, 5)
    with pytest.raises(ValueError, match="max_q_len"):
        prefill_attention(q, cache, cache, cu, lens, tables, 1.0, -1)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        prefill_attention(q, cache, cache, cu, lens, torch.zeros(1, 4, dtype=torch.int32)[:, ::2], 1.0, 5)
    with pytest.raises(ValueError, match="scale"):
        prefill_attention(q, cache, cache, cu, lens, tables, float("nan"), 5)
    with pytest.raises(TypeError, match="config"):
        prefill_attention(q, cache, cache, cu, lens, tables, 1.0, 5, config=DecodeConfig())


# ----------------------------------------------------------------------------- qk_norm_rope_store

from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store  # noqa: E402
from minivllm.kernels.reference import qk_norm_rope_store_reference  # noqa: E402
from tests.kernels.problems import make_qk_norm_problem  # noqa: E402

QK_NORM_CASES = [(t, h, hkv, d) for t in (1, 5, 37) for h, hkv in ((4, 2), (2, 1), (6, 3)) for d in (16, 64)]

# bf16 (the models' dtype) on every case; fp32 and fp16 on every head layout and head size at
# the longest batch (the 54-case full grid took 22 s of the suite's CPU time for no more reach).
QK_NORM_GRID = [(c, torch.bfloat16) for c in QK_NORM_CASES] + [
    (c, dtype) for dtype in (torch.float32, torch.float16) for c in QK_NORM_CASES if c[0] == 37]


@pytest.mark.parametrize("case,dtype", QK_NORM_GRID,
                         ids=lambda v: f"t{v[0]}-h{v[1]}/{v[2]}-d{v[3]}" if isinstance(v, tuple) else str(v)[6:])
def test_qk_norm_rope_store_matches_reference(case: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    check_qk_norm_rope_store(case, dtype, norm=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(5, 4, 2, 16), (37, 6, 3, 64)], ids=lambda c: f"t{c[0]}-h{c[1]}/{c[2]}-d{c[3]}")
def test_rope_store_without_norm_matches_reference(case: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    """No norm weights (Qwen2, Llama): RoPE and the store only."""
    check_qk_norm_rope_store(case, dtype, norm=False)


def check_qk_norm_rope_store(case: tuple[int, int, int, int], dtype: torch.dtype, norm: bool) -> None:
    t, h, hkv, d = case
    gen = torch.Generator().manual_seed(t * 1000 + h * 10 + d)
    args, ref_args = make_qk_norm_problem(t, h, hkv, d, dtype, gen, norm=norm)
    q = qk_norm_rope_store(*args)
    q_ref = qk_norm_rope_store_reference(*ref_args)
    assert q.shape == (t, h, d) and q.dtype == dtype and q.is_contiguous()
    k_cache, v_cache, k_ref, v_ref = args[6], args[7], ref_args[6], ref_args[7]
    assert torch.equal(v_cache, v_ref), "v must be copied unchanged, and only at valid slots"
    # fp32/fp16: the sum of squares' order (rstd within 1 fp32 ulp). The interpreter
    # rounds fp32 -> bf16 toward zero (the GPU rounds to nearest): a few bf16 ulps.
    atol, rtol = {torch.float32: (2e-6, 2e-6), torch.float16: (4e-3, 1e-3), torch.bfloat16: (6e-2, 2e-2)}[dtype]
    torch.testing.assert_close(q, q_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(k_cache, k_ref, atol=atol, rtol=rtol)
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool)
    untouched.view(-1)[args[8][args[8] >= 0]] = False
    assert torch.equal(k_cache[untouched], k_ref[untouched])


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "rope-only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", [(5, 4, 2, 16), (37, 6, 3, 64)], ids=lambda c: f"t{c[0]}-h{c[1]}/{c[2]}-d{c[3]}")
def test_qk_norm_rope_store_is_bit_identical_on_exact_sums(case: tuple[int, int, int, int],
                                                           dtype: torch.dtype, norm: bool) -> None:
    """With sums of squares exact in any order, every rounding is the reference's: equal bits
    (without the norm, always: RoPE has no sum)."""
    gen = torch.Generator().manual_seed(11)
    args, ref_args = make_qk_norm_problem(*case, dtype, gen, exact_sums=norm, norm=norm)
    assert torch.equal(qk_norm_rope_store(*args), qk_norm_rope_store_reference(*ref_args))
    assert torch.equal(args[6], ref_args[6]) and torch.equal(args[7], ref_args[7])


def test_qk_norm_rope_store_cache_view_and_int32_indices() -> None:
    """One layer's caches as views of the engine's (L, 2, N, bs, Hkv, D) tensor; int32 positions/slots."""
    gen = torch.Generator().manual_seed(5)
    args, ref_args = make_qk_norm_problem(6, 4, 2, 16, torch.float32, gen)
    kv = torch.randn(3, 2, *args[6].shape, generator=gen)
    kv_ref = kv.clone()
    args[6], args[7] = kv[1, 0], kv[1, 1]
    ref_args[6], ref_args[7] = kv_ref[1, 0], kv_ref[1, 1]
    args[1], args[8] = args[1].int(), args[8].int()
    q = qk_norm_rope_store(*args)
    torch.testing.assert_close(q, qk_norm_rope_store_reference(*ref_args), atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(kv, kv_ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(kv[[0, 2]], kv_ref[[0, 2]])   # other layers untouched


def test_qk_norm_rope_store_empty_batch() -> None:
    args, _ = make_qk_norm_problem(0, 4, 2, 16, torch.float32, torch.Generator().manual_seed(0))
    assert qk_norm_rope_store(*args).shape == (0, 4, 16)


def test_qk_norm_rope_store_rejects_bad_arguments() -> None:
    args, _ = make_qk_norm_problem(3, 4, 2, 16, torch.float32, torch.Generator().manual_seed(0))

    def call(**changes: object) -> None:
        names = ["qkv", "positions", "q_weight", "k_weight", "eps", "cos_sin_cache", "k_cache", "v_cache",
                 "slot_mapping"]
        kwargs = dict(zip(names, args))
        kwargs.update(changes)
        qk_norm_rope_store(**kwargs)  # type: ignore[arg-type]

    qkv, cache = args[0], args[6]
    with pytest.raises(TypeError, match="q_weight"):
        call(q_weight=args[2].half())
    with pytest.raises(TypeError, match="cos_sin_cache"):
        call(cos_sin_cache=args[5].double())
    with pytest.raises(TypeError, match="slot_mapping"):
        call(slot_mapping=args[8].float())
    with pytest.raises(TypeError, match="eps"):
        call(eps="1e-6")
    with pytest.raises(ValueError, match="both None"):
        call(k_weight=None)
    with pytest.raises(ValueError, match="qkv"):
        call(qkv=qkv[:, :-8])                       # not a multiple of D wide
    with pytest.raises(ValueError, match="qkv"):
        call(qkv=qkv[:, :4 * 16])                   # no room for a q head
    with pytest.raises(ValueError, match="contiguous last dimension"):
        call(qkv=qkv.t().contiguous().t())
    with pytest.raises(ValueError, match="positions"):
        call(positions=args[1][:2])
    with pytest.raises(ValueError, match="k_cache and v_cache"):
        call(v_cache=cache[:, :2])
    with pytest.raises(ValueError, match="head_dim"):
        call(k_cache=torch.zeros(4, 4, 2, 12), v_cache=torch.zeros(4, 4, 2, 12))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        call(cos_sin_cache=args[5][:, :8])
    with pytest.raises(ValueError, match="k_weight"):
        call(k_weight=args[3][:8])


def spy_on(monkeypatch, module: object, name: str, seen: list) -> None:
    """Record the arguments of every call of ``module.name`` (``Ops`` looks kernels up at call time)."""
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (seen.append(a), real(*a, **k))[1])


def test_model_on_triton_kernels_matches_torch_references(tmp_path, monkeypatch) -> None:
    """Tiny Qwen3, float32: ``kernels="triton"`` (every op a Triton kernel, on the CPU
    interpreter) against ``kernels="torch"`` on a ragged prefill, a decode step and a
    prefill over a cached prefix; K/V caches compared too. Each layer calls the fused
    q/k-norm + RoPE + store kernel once, the RMSNorm kernel twice (and the final norm
    once) and the SiLU-and-mul kernel once."""
    from minivllm.kernels import qk_norm_rope_store as qk_mod, rms_norm as norm_mod, silu_and_mul as silu_mod
    from minivllm.testing import TinyConfig, make_hf_model, make_model_executor, make_plan, save_hf_model

    path = save_hf_model(make_hf_model(TinyConfig()), tmp_path)
    bs = 4
    executors = {name: make_model_executor(path, device="cpu", dtype="float32", kernels=name,
                                           block_size=bs, num_blocks=16, max_num_seqs=4,
                                           max_num_batched_tokens=64)
                 for name in ("torch", "triton")}
    a, b, c = [3, 14, 15, 92, 65, 35, 8], [9, 79, 32, 38, 46], [26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69]
    plans = [
        make_plan([(a, 0, (9, 2, 14), True), (b, 0, (5, 11, 0), True)], bs),                  # prefill
        make_plan([([1], 7, (9, 2, 14), True), ([2], 5, (5, 11, 0), True)], bs),              # decode
        make_plan([(c[:6], 0, (3, 12, 7), False)], bs),                                       # first chunk
        make_plan([(c[6:], 6, (3, 12, 7), True), ([5, 6, 7], 0, (1,), True)], bs),            # cached prefix
    ]
    seen: dict[str, list] = {"qk": [], "norm": [], "silu": []}
    for plan in plans:
        logits = {"torch": executors["torch"].compute_logits(plan).float()}
        with monkeypatch.context() as m:
            for key, mod, name in (("qk", qk_mod, "qk_norm_rope_store"), ("norm", norm_mod, "rms_norm"),
                                   ("silu", silu_mod, "silu_and_mul")):
                spy_on(m, mod, name, seen[key])
            logits["triton"] = executors["triton"].compute_logits(plan).float()
        torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(executors["triton"].kv_cache, executors["torch"].kv_cache, atol=1e-5, rtol=1e-5)
    layers = len(executors["triton"].model.model.layers)
    assert {k: len(v) for k, v in seen.items()} == {"qk": layers * len(plans), "norm": (2 * layers + 1) * len(plans),
                                                    "silu": layers * len(plans)}


def test_families_without_qk_norm_take_the_fused_kernel_without_norm(tmp_path, monkeypatch) -> None:
    """Qwen2 and Llama have no q/k norm: they take the fused kernel with no norm weights
    (RoPE + K/V store in one launch). Qwen2 (q/k/v bias; Llama takes the same branch) on the
    CPU interpreter: the Triton kernels give the torch references' logits and K/V, and every
    layer's call passed no weights (a planted bug that normalised anyway, or skipped the
    kernel, fails here)."""
    from minivllm.kernels import qk_norm_rope_store as qk_mod
    from minivllm.testing import TinyConfig, make_hf_model, make_model_executor, make_plan, save_hf_model

    path = save_hf_model(make_hf_model(TinyConfig(family="qwen2", hidden_size=64, head_dim=16)), tmp_path)
    bs = 4
    executors = {name: make_model_executor(path, device="cpu", dtype="float32", kernels=name,
                                           block_size=bs, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=64)
                 for name in ("torch", "triton")}
    calls: list[tuple] = []
    spy_on(monkeypatch, qk_mod, "qk_norm_rope_store", calls)
    a, b = [3, 14, 15, 92, 65, 35, 8, 40, 41], [9, 79, 32, 38, 46]
    plans = [make_plan([(a, 0, (9, 2, 14), True), (b, 0, (5, 11, 0), True)], bs),      # prefill
             make_plan([([1], 9, (9, 2, 14), True), ([2], 5, (5, 11, 0), True)], bs)]  # decode
    for plan in plans:
        logits = {name: ex.compute_logits(plan).float() for name, ex in executors.items()}
        torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(executors["triton"].kv_cache, executors["torch"].kv_cache, atol=1e-5, rtol=1e-5)
    layers = len(executors["triton"].model.model.layers)
    assert [(c[2], c[3]) for c in calls] == [(None, None)] * (layers * len(plans))


# ----------------------------------------------------------------------------- rms_norm, silu_and_mul

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100])  # a power of two, and a masked tail
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    from minivllm.kernels.reference import add_rms_norm_ref, rms_norm_ref
    from minivllm.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(hidden)
    x = (30 * torch.randn(2, 5, hidden, generator=gen)).to(dtype)
    r = (300 * torch.randn(2, 5, hidden, generator=gen)).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    got = rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    want = rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    got, res = rms_norm(x, w, 1e-6, residual=r)
    want, want_res = add_rms_norm_ref(x, r, w, 1e-6)
    if dtype != torch.bfloat16:  # the interpreter truncates fp32 -> bf16 casts (CUDA rounds to nearest)
        assert torch.equal(res, want_res)  # the new residual stream: one rounding of the sum, as torch
    torch.testing.assert_close(res.float(), want_res.float(), atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # Rows that are a strided view (heads of a packed projection), and an fp32 weight on bf16 rows.
    packed = torch.randn(4, 3 * hidden, generator=gen).to(dtype)
    heads = packed[:, hidden:].view(4, 2, hidden)
    torch.testing.assert_close(rms_norm(heads, w, 1e-6).float(), rms_norm_ref(heads, w, 1e-6).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])
    w32 = w.float()
    assert rms_norm(x, w32, 1e-6).dtype == rms_norm_ref(x, w32, 1e-6).dtype
    assert rms_norm(x[:0], w, 1e-6).shape == (0, 5, hidden)


def test_rms_norm_rounds_the_normalised_value_before_the_weight() -> None:
    """fp16 (the interpreter rounds fp16 as CUDA does; its bf16 casts truncate): a planted
    kernel that multiplies the fp32 normalised value by the weight (one rounding fewer)
    differs from the reference on these values; ours is bit-identical."""
    from minivllm.kernels.reference import rms_norm_ref
    from minivllm.kernels.rms_norm import rms_norm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16, 64, generator=gen).half()
    w = (1 + 0.3 * torch.randn(64, generator=gen)).half()
    assert torch.equal(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    x32 = x.float()
    one_rounding = (w.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).half()
    assert not torch.equal(one_rounding, rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [48, 1500])  # one tile with a tail; two tiles of 1024
def test_silu_and_mul_matches_reference(dtype: torch.dtype, inner: int) -> None:
    from minivllm.kernels.reference import silu_and_mul_ref
    from minivllm.kernels.silu_and_mul import silu_and_mul

    gen = torch.Generator().manual_seed(inner)
    x = (4 * torch.randn(3, 2, 2 * inner, generator=gen)).to(dtype)
    got = silu_and_mul(x)
    assert got.shape == (3, 2, inner) and got.dtype == dtype
    want = silu_and_mul_ref(x)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if dtype == torch.float16:  # each op rounds as torch's (bf16: the interpreter truncates)
        assert (got != want).float().mean() < 0.01
    wide = torch.randn(4, 4 * inner, generator=gen).to(dtype)[:, :2 * inner]  # strided rows
    torch.testing.assert_close(silu_and_mul(wide).float(), silu_and_mul_ref(wide).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


def test_norm_and_activation_kernels_take_pdl_harmlessly_off_a_gpu() -> None:
    """``pdl=True`` (let the next kernel start early) changes nothing off a Hopper GPU."""
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.silu_and_mul import silu_and_mul

    gen = torch.Generator().manual_seed(2)
    x, r = torch.randn(3, 64, generator=gen).half(), torch.randn(3, 64, generator=gen).half()
    w = (1 + 0.2 * torch.randn(64, generator=gen)).half()
    assert torch.equal(rms_norm(x, w, 1e-6, pdl=True), rms_norm(x, w, 1e-6))
    for got, want in zip(rms_norm(x, w, 1e-6, r, pdl=True), rms_norm(x, w, 1e-6, r)):
        assert torch.equal(got, want)
    g = torch.randn(3, 128, generator=gen).half()
    assert torch.equal(silu_and_mul(g, pdl=True), silu_and_mul(g))


def test_norm_and_activation_kernels_reject_bad_arguments() -> None:
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.silu_and_mul import silu_and_mul

    x, w = torch.randn(4, 8), torch.ones(8)
    with pytest.raises(TypeError, match="x"):
        rms_norm(x.long(), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.randn(8, 4).t(), w, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=torch.randn(4, 9))
    with pytest.raises(TypeError, match="residual"):
        rms_norm(x, w, 1e-6, residual=x.half())
    with pytest.raises(ValueError, match="2I"):
        silu_and_mul(torch.randn(4, 7))
    with pytest.raises(TypeError, match="x"):
        silu_and_mul(torch.ones(4, 8, dtype=torch.int32))


def test_next_pow2_matches_triton() -> None:
    import triton

    from minivllm.kernels._launch import next_pow2

    assert [next_pow2(n) for n in (0, 1, 2, 3, 4, 5, 1023, 1024, 1025)] == [1, 1, 2, 4, 4, 8, 1024, 1024, 2048]
    assert all(next_pow2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
