"""Triton kernels vs the torch references on CUDA, at Qwen3 shapes.

16 query heads, 8 KV heads, head_dim 128 (plus groups of 4 and 5), contexts up to
8192, batches up to 256, blocks scattered over a pool twice the need, -1 padded
tables, cache slots no sequence owns set to NaN (a read past a mask shows up).
The reference runs in fp32 on the *same* low-precision inputs.

Tolerances (abs and rel, elementwise): fp32 1e-4 (tl.dot with input_precision
"ieee"; exp2 is the hardware approximation); fp16 2e-3; bf16 1.6e-2 (output
rounding plus P rounded to bf16 before P @ V).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minivllm.kernels.decode_attention import DecodeConfig, decode_attention
from minivllm.kernels.prefill_attention import PrefillConfig, prefill_attention
from minivllm.kernels.reference import paged_attention_reference

DEVICE = "cuda"
H, HKV, D = 16, 8, 128
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_paged_kv(
    kv_lens: list[int], block_size: int, num_kv_heads: int, dtype: torch.dtype, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V at the context slots of each sequence, NaN elsewhere; blocks drawn at
    random from a pool twice the need. Returns k_cache, v_cache (N, bs, Hkv, D) and
    block_tables (B, W) int32, -1 padded with at least one padding column."""
    need = torch.tensor([-(-n // block_size) for n in kv_lens])
    num_blocks = 2 * int(need.sum()) + 8
    width = int(need.max()) + 1
    perm = torch.randperm(num_blocks, generator=gen, device=DEVICE).to(torch.int32)
    owned = torch.arange(width)[None, :] < need[:, None]                  # (B, W)
    tables = torch.full((len(kv_lens), width), -1, dtype=torch.int32, device=DEVICE)
    tables[owned.to(DEVICE)] = perm[: int(need.sum())]
    lens = torch.tensor(kv_lens, device=DEVICE)
    pos = torch.arange(width * block_size, device=DEVICE)
    valid = pos[None, :] < lens[:, None]                                    # (B, W*bs)
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size)[valid]
    caches = []
    for _ in range(2):
        cache = torch.full((num_blocks, block_size, num_kv_heads, D), float("nan"), dtype=dtype, device=DEVICE)
        cache.view(-1, num_kv_heads, D)[slots] = torch.randn(
            len(slots), num_kv_heads, D, generator=gen, device=DEVICE).to(dtype)
        caches.append(cache)
    return caches[0], caches[1], tables


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Finite, elementwise within the dtype's tolerance, and small relative norm error."""
    assert torch.isfinite(out).all(), "kernel output holds NaN/inf"
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    rel = (out.float() - ref).norm() / ref.norm().clamp_min(1e-12)
    assert rel < TOL[dtype] / 2, f"relative error {rel:.2e}"


def reference_fp32(q, k_cache, v_cache, cu_seqlens_q, kv_lens, block_tables, scale) -> torch.Tensor:
    """The torch reference in fp32 on the same (possibly low-precision) inputs."""
    return paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), cu_seqlens_q, kv_lens,
                                     block_tables, scale)


def _decode_lens(name: str, gen: torch.Generator) -> list[int]:
    """Context lengths of one decode batch."""
    if name == "b256-upto1k":
        lens = torch.randint(1, 1025, (256,), generator=gen, device=DEVICE).tolist()
        lens[:4] = [0, 1, 1024, 17]
        return lens
    if name == "b8-upto8k":
        return [8192, 8191, 1, 0, 4097, 16, 8000, 3000]
    if name == "b64-mixed":
        short = torch.randint(1, 33, (32,), generator=gen, device=DEVICE).tolist()
        long = torch.randint(6000, 8193, (32,), generator=gen, device=DEVICE).tolist()
        return [x for pair in zip(short, long) for x in pair]
    if name == "b1-8k":
        return [8192]
    raise ValueError(name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", ["b256-upto1k", "b8-upto8k", "b64-mixed", "b1-8k"])
def test_decode_attention(batch: str, dtype: torch.dtype) -> None:
    gen = torch.Generator(DEVICE).manual_seed(1)
    lens = _decode_lens(batch, gen)
    k_cache, v_cache, tables = make_paged_kv(lens, 16, HKV, dtype, gen)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), H, D, generator=gen, device=DEVICE).to(dtype)
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5)
    for num_splits, config in ((None, None), (1, None), (7, None), (7, DecodeConfig(block_n=32))):
        out = decode_attention(q, k_cache, v_cache, kv_lens, tables, D ** -0.5, num_splits=num_splits,
                               config=config)
        assert_close(out, ref, dtype)
        assert (out[kv_lens == 0] == 0).all()


@pytest.mark.parametrize("block_size", [1, 4, 128])
def test_decode_attention_block_sizes(block_size: int) -> None:
    gen = torch.Generator(DEVICE).manual_seed(block_size)
    lens = [1, 130, 0, 2000, 129, 4096]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, HKV, torch.bfloat16, gen)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), H, D, generator=gen, device=DEVICE).bfloat16()
    cu = torch.arange(len(lens) + 1, dtype=torch.int32, device=DEVICE)
    ref = reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5)
    assert_close(decode_attention(q, k_cache, v_cache, kv_lens, tables, D ** -0.5), ref, torch.bfloat16)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_decode_attention_cuda_graph(pdl: bool) -> None:
    """Captured once, replayed on new lengths / tables / queries (including padding rows
    with kv_len 0): the split count came from shapes, so every replay is right (``pdl``: the
    merge lets the next kernel start early)."""
    gen = torch.Generator(DEVICE).manual_seed(2)
    batch, width, bs = 32, 256, 16
    shape = (batch * width, bs, HKV, D)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).bfloat16()
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).bfloat16()
    q = torch.zeros(batch, H, D, dtype=torch.bfloat16, device=DEVICE)
    kv_lens = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    tables = torch.full((batch, width), -1, dtype=torch.int32, device=DEVICE)

    def fill(lens: list[int]) -> None:
        q.copy_(torch.randn(batch, H, D, generator=gen, device=DEVICE))
        kv_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        tables.fill_(-1)
        perm = torch.randperm(k_cache.shape[0], generator=gen, device=DEVICE).to(torch.int32)
        for b, n in enumerate(lens):
            tables[b, : -(-n // bs)] = perm[b * width: b * width + -(-n // bs)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fill([100] * batch)
        decode_attention(q, k_cache, v_cache, kv_lens, tables, D ** -0.5, pdl=pdl)  # compile outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k_cache, v_cache, kv_lens, tables, D ** -0.5, pdl=pdl)

    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    for trial in range(3):
        lens = torch.randint(1, width * bs + 1, (batch,), generator=gen, device=DEVICE).tolist()
        lens[-4 * trial - 1:] = [0] * (4 * trial + 1)        # CUDA-graph padding rows
        fill(lens)
        graph.replay()
        ref = reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5)
        assert_close(out, ref, torch.bfloat16)
        assert (out[-4 * trial - 1:] == 0).all()


PREFILL_BATCH = [
    # (q_len, kv_len): full prefill, a chunk over a long prefix, decode-like, prefix-cache
    # hit, an empty row, a short prompt, a later chunk
    (2048, 2048), (512, 8192), (1, 5000), (300, 301), (0, 0), (17, 17), (1000, 3000),
]


def prefill_case(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, dtype: torch.dtype,
                 seed: int, lead: int = 0, tail: int = 0, block_size: int = 16) -> tuple[torch.Tensor, ...]:
    """A paged prefill batch of (q_len, kv_len) sequences: (q, k_cache, v_cache, cu_seqlens_q,
    kv_lens, block_tables, max_q_len); ``lead``/``tail`` q rows before/after the sequences."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    q_lens = [ql for ql, _ in seqs]
    lens = [kl for _, kl in seqs]
    k_cache, v_cache, tables = make_paged_kv(lens, block_size, num_kv_heads, dtype, gen)
    cu = torch.tensor([lead] + q_lens, device=DEVICE).cumsum(0).to(torch.int32)
    kv_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(int(cu[-1]) + tail, num_heads, D, generator=gen, device=DEVICE).to(dtype)
    return q, k_cache, v_cache, cu, kv_lens, tables, max(q_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(16, 8), (40, 8)], ids=["gqa2", "gqa5"])
def test_prefill_attention(heads: tuple[int, int], dtype: torch.dtype) -> None:
    q, k_cache, v_cache, cu, kv_lens, tables, max_q = prefill_case(PREFILL_BATCH, *heads, dtype, seed=3)
    ref = reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5)
    out = prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5, max_q)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_attention_tile_map(dtype: torch.dtype) -> None:
    """Map mode (a batch-independent grid, for CUDA graphs) equals the grid mode bit for bit
    on the mixed batch at Qwen3 shapes, with idle map rows; it replays in a CUDA graph."""
    from minivllm.kernels.prefill_attention import build_tile_map, default_config, tile_rows

    q, k_cache, v_cache, cu, kv_lens, tables, max_q = prefill_case(PREFILL_BATCH, 16, 8, dtype, seed=5)
    config = default_config(dtype, D, max_q)
    grid_out = prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5, max_q, config=config)
    q_lens = (cu[1:] - cu[:-1]).cpu().numpy()
    tile_map = torch.from_numpy(build_tile_map(q_lens, tile_rows(config, 16, 8), 4096)).to(DEVICE)
    run = lambda: prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5, 0,  # noqa: E731
                                    config=config, tile_map=tile_map)
    assert torch.equal(run(), grid_out)
    run()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, grid_out)


# Tile configs beside the defaults (benchmarks/prefill_attention.py times them): the
# unmasked/masked loop split with 32..256-row tiles, 32..128-key tiles, both grid orders.
PREFILL_CONFIGS = [
    PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 128, 8, 2), PrefillConfig(128, 32, 8, 4),
    PrefillConfig(256, 32, 8, 3), PrefillConfig(64, 64, 4, 3), PrefillConfig(64, 64, 4, 2, heavy_first=False),
]


@pytest.mark.parametrize("config", PREFILL_CONFIGS,
                         ids=lambda c: f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}"
                                       f"{'' if c.heavy_first else '-perhead'}")
def test_prefill_attention_configs(config: PrefillConfig) -> None:
    """Every swept config on the mixed batch, with rows before and after the sequences
    (the output is torch.empty: the kernel itself must zero them)."""
    lead = 3
    q, k_cache, v_cache, cu, kv_lens, tables, max_q = prefill_case(PREFILL_BATCH, H, HKV, torch.bfloat16,
                                                                    seed=4, lead=lead, tail=200)
    ref = reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5)
    out = prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5, max_q, config=config)
    assert_close(out, ref, torch.bfloat16)
    assert (out[:lead] == 0).all() and (out[int(cu[-1]):] == 0).all()


TMA_CASES = [(PrefillConfig(128, 64, 8, 3), 64), (PrefillConfig(128, 64, 8, 2), 64), (PrefillConfig(64, 64, 4, 3), 64),
             (PrefillConfig(128, 64, 8, 3), 128), (PrefillConfig(128, 128, 8, 2), 128)]


@pytest.mark.parametrize("config, block_size", TMA_CASES,
                         ids=[f"m{c.block_m}n{c.block_n}w{c.num_warps}s{c.num_stages}-bs{bs}" for c, bs in TMA_CASES])
def test_prefill_attention_tma_path(config: PrefillConfig, block_size: int) -> None:
    """The TMA path (unmasked tiles as boxes of the cache; unowned slots NaN) on the mixed
    batch: against the reference, bit-equal to the pointer path, and in a CUDA graph."""
    from minivllm.kernels._launch import tma_allowed

    q, k_cache, v_cache, cu, kv_lens, tables, max_q = prefill_case(PREFILL_BATCH, H, HKV, torch.bfloat16, seed=6,
                                                                    block_size=block_size)
    assert tma_allowed(k_cache, config.block_n)
    args = (q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5, max_q)
    out = prefill_attention(*args, config=config)
    assert_close(out, reference_fp32(*args[:7]), torch.bfloat16)
    assert torch.equal(out, prefill_attention(*args, config=dataclasses.replace(config, tma=False)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = prefill_attention(*args, config=config)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


LOOP_SPLIT_SEQS = [
    # (q_len, kv_len): a tile's first position on, just before and just after a 64-key tile
    # edge; chunks of 1, 63, 64, 65 tokens; q_len 1 among long prompts
    [(65, 65 + 63), (64, 64 + 64), (63, 63 + 65), (1, 1 + 127), (1, 1), (130, 130), (640, 700)],
    # short chunks only: max_q_len < 128 picks the 64-row default
    [(65, 65 + 63), (1, 1 + 127), (17, 17), (100, 1000), (0, 5)],
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs", LOOP_SPLIT_SEQS, ids=["long", "short"])
def test_prefill_attention_loop_split_edges(seqs: list[tuple[int, int]], dtype: torch.dtype) -> None:
    q, k_cache, v_cache, cu, kv_lens, tables, max_q = prefill_case(seqs, H, HKV, dtype, seed=5)
    ref = reference_fp32(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5)
    out = prefill_attention(q, k_cache, v_cache, cu, kv_lens, tables, D ** -0.5, max_q)
    assert_close(out, ref, dtype)


# ----------------------------------------------------------------------------- qk_norm_rope_store

from minivllm.kernels.qk_norm_rope_store import qk_norm_rope_store  # noqa: E402
from minivllm.kernels.reference import qk_norm_rope_store_reference  # noqa: E402


def cos_sin_table(head_dim: int, max_position: int, base: float) -> torch.Tensor:
    """The (P, D) float32 [cos | sin] table of plain RoPE, as the rotary layer builds it."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # (P, D/2)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
def test_qk_norm_rope_store(num_tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-0.6B shapes, block_size 16, slots scattered over a pool twice the need
    (every 7th row -1), positions up to 40960, caches as one layer of the engine's tensor.

    vs the eager torch reference on the GPU: fp32 within rounding (sum order, torch's
    approximate CUDA rsqrt); bf16 at most one bf16 ulp on a small share of elements."""
    gen = torch.Generator(DEVICE).manual_seed(num_tokens)
    bs, max_pos = 16, 40960
    qkv = (torch.randn(num_tokens, (H + 2 * HKV) * D, generator=gen, device=DEVICE) * 3).to(dtype)
    q_weight = (1 + 0.5 * torch.randn(D, generator=gen, device=DEVICE)).to(dtype)
    k_weight = (1 + 0.5 * torch.randn(D, generator=gen, device=DEVICE)).to(dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen, device=DEVICE)
    cos_sin = cos_sin_table(D, max_pos, 1_000_000.0).to(DEVICE)
    n = 2 * (-(-num_tokens // bs)) + 2
    slots = torch.randperm(n * bs, generator=gen, device=DEVICE)[:num_tokens]
    slots[3::7] = -1
    kv = torch.randn(3, 2, n, bs, HKV, D, generator=gen, device=DEVICE).to(dtype)   # (L, 2, N, bs, Hkv, D)
    kv_ref = kv.clone()
    q = qk_norm_rope_store(qkv, positions, q_weight, k_weight, 1e-6, cos_sin, kv[1, 0], kv[1, 1], slots)
    q_ref = qk_norm_rope_store_reference(qkv, positions, q_weight, k_weight, 1e-6, cos_sin,
                                         kv_ref[1, 0], kv_ref[1, 1], slots)
    assert torch.equal(kv[:, 1], kv_ref[:, 1]), "v copied unchanged, at valid slots only"
    assert torch.equal(kv[[0, 2]], kv_ref[[0, 2]]), "other layers untouched"
    for out, ref in ((q, q_ref), (kv[1, 0], kv_ref[1, 0])):
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        else:
            # One bf16 ulp at |x| <= 16 is <= 2**-4; a different rounding (rstd one fp32
            # ulp away) moves only values near a rounding boundary.
            torch.testing.assert_close(out, ref, atol=2 ** -4, rtol=2 ** -7)
            assert (out != ref).float().mean() < 0.01


def test_qk_norm_rope_store_cuda_graph() -> None:
    """Captured at batch 1 and replayed with new inputs: same as eager (the decode path)."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    qkv = torch.randn(1, (H + 2 * HKV) * D, generator=gen, device=DEVICE).bfloat16()
    weight = torch.ones(D, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    cos_sin = cos_sin_table(D, 1024, 1_000_000.0).to(DEVICE)
    k_cache = torch.zeros(4, 16, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    args = (qkv, positions, weight, weight, 1e-6, cos_sin, k_cache, v_cache, slots)
    qk_norm_rope_store(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qk_norm_rope_store(*args)
    qkv.copy_(torch.randn(qkv.shape, generator=gen, device=DEVICE))
    positions.fill_(777)
    slots.fill_(37)
    graph.replay()
    k_ref, v_ref = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q_ref = qk_norm_rope_store_reference(qkv, positions, weight, weight, 1e-6, cos_sin, k_ref, v_ref, slots)
    torch.cuda.synchronize()
    torch.testing.assert_close(q, q_ref, atol=2 ** -6, rtol=2 ** -7)
    torch.testing.assert_close(k_cache[2, 5], k_ref[2, 5], atol=2 ** -6, rtol=2 ** -7)
    assert torch.equal(v_cache[2, 5], v_ref[2, 5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 256, 8192])
def test_rms_norm_and_silu_and_mul(rows: int, dtype: torch.dtype) -> None:
    """Qwen3-0.6B's hidden 1024 and intermediate 3072: the kernels against their torch
    references on CUDA. Both round where torch rounds, so in bf16/fp16 they differ only where
    rsqrt or exp differ by an fp32 ulp that crosses a rounding boundary: at most 1% of the
    elements (fp32 results keep those ulps: tolerance only)."""
    from minivllm.kernels.reference import add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.silu_and_mul import silu_and_mul

    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    x = (3 * torch.randn(rows, 1024, device=DEVICE, generator=gen)).to(dtype)
    r = (30 * torch.randn(rows, 1024, device=DEVICE, generator=gen)).to(dtype)
    w = (1 + 0.2 * torch.randn(1024, device=DEVICE, generator=gen)).to(dtype)
    g = (4 * torch.randn(rows, 2 * 3072, device=DEVICE, generator=gen)).to(dtype)
    got, res = rms_norm(x, w, 1e-6, residual=r)
    want, want_res = add_rms_norm_ref(x, r, w, 1e-6)
    assert torch.equal(res, want_res)
    pairs = [(got, want), (rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)), (silu_and_mul(g), silu_and_mul_ref(g))]
    for a, b in pairs:
        torch.testing.assert_close(a.float(), b.float(), atol=TOL[dtype], rtol=TOL[dtype])
        if dtype != torch.float32:
            assert (a != b).float().mean().item() <= 0.01


# ----------------------------------------------------------------------------- gemv

@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("n,k,bias", [(3072, 4096, False), (4096, 2048, True), (1000, 3072, False)])
def test_gemv_against_f_linear_in_a_cuda_graph(rows: int, n: int, k: int, bias: bool) -> None:
    """The decode GEMMs of Qwen3-8B at TP=2 (qkv, o with a bias) and a partial last column
    block, bf16, with the default tiles of the row count: eager and replayed in a graph,
    within one bf16 rounding of float32; rows are independent (two rows of the batch
    alone give the same bits; one row alone takes the CUDA-core path, another order)."""
    from minivllm.kernels.gemv import gemv

    gen = torch.Generator(device=DEVICE).manual_seed(rows + n)
    x = torch.randn(rows, k, generator=gen, device=DEVICE).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=gen, device=DEVICE).bfloat16() if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    eager = gemv(x, w, b)
    torch.testing.assert_close(eager.float(), ref, rtol=2 ** -8, atol=2 ** -8 * ref.abs().max().item())
    if rows > 1:
        assert torch.equal(gemv(x[-2:], w, b), eager[-2:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, w, b)
    x.copy_(torch.randn(rows, k, generator=gen, device=DEVICE).bfloat16())
    graph.replay()
    torch.testing.assert_close(out, gemv(x, w, b), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n,k", [(4096, 6144), (1024, 3072)])
def test_gated_gemv_is_silu_and_mul_then_gemv(rows: int, n: int, k: int) -> None:
    """The down projections of Qwen3-8B at TP=2 and of 0.6B, fed [gate | up]: the same bits
    as the SiLU-and-mul kernel then the GEMV, compiled for this GPU (exp included)."""
    from minivllm.kernels.gemv import gemv
    from minivllm.kernels.silu_and_mul import silu_and_mul

    gen = torch.Generator(device=DEVICE).manual_seed(rows + n)
    x = (2 * torch.randn(rows, 2 * k, generator=gen, device=DEVICE)).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / k ** 0.5).bfloat16()
    assert torch.equal(gemv(x, w, gated=True), gemv(silu_and_mul(x), w))


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (6144, 4096), (24576, 4096)])
def test_normed_gemv_is_rms_norm_then_gemv(residual: bool, n: int, k: int) -> None:
    """The qkv and gate_up projections of Qwen3-0.6B and 8B at batch 1 with their residual add +
    RMSNorm inside (``rms_norm_gemv``), compiled for this GPU: the new residual is the RMSNorm
    kernel's bit for bit; the output is the RMSNorm kernel then the GEMV's, up to the row's
    mean square summed in another order (an input element may round one ulp apart)."""
    from minivllm.kernels.gemv import gemv, rms_norm_gemv
    from minivllm.kernels.rms_norm import rms_norm

    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    x = (3 * torch.randn(1, k, generator=gen, device=DEVICE)).bfloat16()
    r = torch.randn(1, k, generator=gen, device=DEVICE).bfloat16() if residual else None
    nw = (1 + 0.2 * torch.randn(k, generator=gen, device=DEVICE)).bfloat16()
    w = (torch.randn(n, k, generator=gen, device=DEVICE) / k ** 0.5).bfloat16()
    y, s = rms_norm_gemv(x, r, nw, 1e-6, w)
    h, s_ref = rms_norm(x, nw, 1e-6, residual=r) if residual else (rms_norm(x, nw, 1e-6), x)
    assert torch.equal(s, s_ref)
    ref = gemv(h, w)
    same = (y == ref).float().mean().item()
    assert same > 0.9, same
    torch.testing.assert_close(y.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("rows", [1, 4])
def test_pdl_chain_in_a_cuda_graph_gives_the_plain_bits(rows: int) -> None:
    """``pdl=True`` on every launch: RMSNorm (signalling early) -> GEMV (launched with
    launch_pdl, streaming its first W tile before its wait) -> SiLU-and-mul -> GEMV, captured
    in a CUDA graph and replayed on new inputs, gives exactly the bits of the plain launches
    (the same sums; a GEMV reading x before RMSNorm finished would not); at one row, GEMV ->
    GEMV -> GEMV as a decode layer's MLP and next qkv run them (normed, gated, normed with the
    residual), each GEMV letting the next start early. Skipped where PDL is not supported
    (pre-Hopper, or a triton without launch_pdl)."""
    from minivllm.kernels._launch import pdl_supported
    from minivllm.kernels.gemv import gemv, rms_norm_gemv
    from minivllm.kernels.rms_norm import rms_norm
    from minivllm.kernels.silu_and_mul import silu_and_mul

    if not pdl_supported(torch.device(DEVICE)):
        pytest.skip("programmatic dependent launch is not supported here")
    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    h, inter = 1024, 3072
    x = torch.randn(rows, h, generator=gen, device=DEVICE).bfloat16()
    norm_w = (1 + 0.1 * torch.randn(h, generator=gen, device=DEVICE)).bfloat16()
    w_up = (torch.randn(2 * inter, h, generator=gen, device=DEVICE) / h ** 0.5).bfloat16()
    w_down = (torch.randn(h, inter, generator=gen, device=DEVICE) / inter ** 0.5).bfloat16()

    def chain(inp: torch.Tensor, pdl: bool) -> torch.Tensor:
        if rows == 1:
            # The decode step's kernels: GEMV after GEMV (each signals the next early), the
            # norm and the activation inside them, each waiting before it reads its input.
            up = rms_norm_gemv(inp, None, norm_w, 1e-6, w_up, pdl=pdl)[0]
            down = gemv(up, w_down, gated=True, pdl=pdl)
            return rms_norm_gemv(down, inp, norm_w, 1e-6, w_up, pdl=pdl)[0]
        normed = rms_norm(inp, norm_w, 1e-6, pdl=pdl)
        return gemv(silu_and_mul(gemv(normed, w_up, pdl=pdl), pdl=pdl), w_down, pdl=pdl)

    plain_first = chain(x, pdl=False)
    x2 = torch.randn(rows, h, generator=gen, device=DEVICE).bfloat16()
    plain_second = chain(x2, pdl=False)
    assert torch.equal(chain(x, pdl=True), plain_first)  # eager, with PDL
    static = x.clone()
    chain(static, pdl=True)  # compile every variant before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static, pdl=True)
    static.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain_second)


@pytest.mark.parametrize("rows", [1, 8, 256])
def test_one_launch_sampling_and_the_vocab_shard_lookup_match_their_references(rows: int) -> None:
    """The sampling kernel with its splits met in the launch (``gumbel_sample.py``: the last
    program of a row writes the winner) on a TP=2 vocab shard of Qwen3 and on a whole row,
    greedy and random rows mixed, three launches on one counter buffer; and the vocab-parallel
    embedding lookup (``vocab_embedding.py``) at Qwen3-8B's hidden size, ids on both ranks."""
    from minivllm.kernels.gumbel_sample import (
        choose_num_splits, GumbelConfig, gumbel_best_reference, gumbel_pairs, gumbel_sample,
        gumbel_sample_reference,
    )
    from minivllm.kernels.reference import vocab_shard_embedding_reference
    from minivllm.kernels.vocab_embedding import vocab_shard_embedding

    gen = torch.Generator(device=DEVICE).manual_seed(rows)
    vocab, shard = 151936, 75968
    assert choose_num_splits(rows, shard, torch.device(DEVICE), GumbelConfig()) > 1  # the splits meet
    logits = (torch.randn(rows, vocab, generator=gen, device=DEVICE) * 3).to(torch.bfloat16)
    temperature = torch.rand(rows, generator=gen, device=DEVICE) + 0.5
    greedy = torch.arange(rows, device=DEVICE) % 2 == 0
    seeded = torch.arange(rows, device=DEVICE) % 3 == 1
    keys = torch.randint(0, 2 ** 32, (rows, 2), generator=gen, device=DEVICE) * seeded[:, None]
    counts = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    for step in range(3):
        part = logits[:, shard:].contiguous()
        pairs = gumbel_pairs(part, temperature, None, greedy, seeded, keys, step, col_offset=shard, counts=counts)
        value, col = gumbel_best_reference(part, temperature, None, greedy, seeded, keys, step, col_offset=shard)
        assert torch.equal(pairs[:, 1], (col + shard).float()), "shard winners differ"
        torch.testing.assert_close(pairs[:, 0], value, rtol=1e-5, atol=1e-5)
        got = gumbel_sample(logits, temperature, None, greedy, seeded, keys, step, counts=counts)
        assert torch.equal(got, gumbel_sample_reference(logits, temperature, None, greedy, seeded, keys, step))
        assert torch.equal(got[greedy], logits[greedy].argmax(dim=-1))
        assert counts.eq(0).all()
    table = torch.randn(shard, 4096, generator=gen, device=DEVICE).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (rows,), generator=gen, device=DEVICE)
    ids[0] = shard  # the last rank's first id
    for start in (0, shard):
        got = vocab_shard_embedding(ids, table, start, start + shard)
        assert torch.equal(got, vocab_shard_embedding_reference(ids, table, start, start + shard))
