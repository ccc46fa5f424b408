"""The sparse-MLP kernels (``kernels/moe_topk.py``, ``moe_align.py``, ``fused_moe.py``;
TRITON_INTERPRET=1 here) against their torch references, and the references against
transformers' ``Qwen3MoeSparseMoeBlock``."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from minivllm.kernels.fp8 import FP8_DTYPE  # noqa: E402
from minivllm.kernels.fused_moe import FusedMoeConfig, default_tiles, fused_moe  # noqa: E402
from minivllm.kernels.moe_align import (  # noqa: E402
    GRID_TILES, MAX_TILE_CHUNKS, ONE_PROGRAM_MAX_CHUNKS, MoeAlignment, grid_tile_chunks, max_blocks, moe_align,
)
from minivllm.kernels.moe_sum import moe_sum  # noqa: E402
from minivllm.kernels.moe_topk import moe_topk  # noqa: E402
from minivllm.kernels.reference import (  # noqa: E402
    fused_moe_reference, moe_align_reference, moe_sum_reference, moe_topk_reference,
)

SMALL = FusedMoeConfig(block_n=16, block_k=16)  # several column blocks and K steps at H = 32


def crafted_ids(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """(T, k) int32 ids, distinct per token: expert 0 receives every token, the last expert
    none (when E > k), the others in turn."""
    others = experts - 1 if experts > top_k else experts
    rows = [[0] + [1 + (t + j) % (others - 1) for j in range(top_k - 1)] if others > 1 else [0]
            for t in range(tokens)]
    return torch.tensor(rows, dtype=torch.int32)


def expert_weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    return w13, w2


@pytest.mark.parametrize("tokens,experts,top_k,norm", [
    (1, 8, 2, True),     # decode
    (17, 8, 2, False),
    (9, 6, 3, True),     # E not a power of two: padded lanes never chosen
    (5, 4, 4, False),    # k = E: every expert, largest first
    (3, 1, 1, True),
])
def test_topk_is_reference(tokens, experts, top_k, norm) -> None:
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)) * 3
    weights, ids = moe_topk(logits, top_k, norm)
    ref_weights, ref_ids = moe_topk_reference(logits, top_k, norm)
    assert weights.shape == ids.shape == (tokens, top_k) and ids.dtype == torch.int32
    assert [set(r) for r in ids.tolist()] == [set(r) for r in ref_ids.tolist()]
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)
    # Largest first, as torch.topk: the columns line up, not just the sets.
    assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_of_16_bit_logits_is_that_of_their_float32_values(dtype) -> None:
    """The router's logits come in the model's dtype; widened in the kernel, they give what
    the float32 copy of the same values gives (transformers' softmax widens them so)."""
    logits = (torch.randn(9, 8, generator=torch.Generator().manual_seed(3)) * 3).to(dtype)
    got, want = moe_topk(logits, 2, True), moe_topk(logits.float(), 2, True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref_weights, ref_ids = moe_topk_reference(logits, 2, True)
    assert torch.equal(got[1], ref_ids)
    torch.testing.assert_close(got[0], ref_weights, rtol=0, atol=1e-6)


TOPK_IMPLS = {"kernel": moe_topk, "reference": moe_topk_reference}


@pytest.mark.parametrize("impl", sorted(TOPK_IMPLS))
@pytest.mark.parametrize("logits,top_k,want", [
    ([[1.0, 1.0, 0.0, 0.0]], 1, [0]),                  # torch.topk returns 1 here
    ([[0.0, 2.0, 2.0, 2.0]], 2, [1, 2]),
    ([[3.0, 1.0, 1.0, 1.0]], 2, [0, 1]),               # the tie sits at the k boundary
    ([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], 4, [0, 1, 2, 3]),
    ([[-float("inf"), -float("inf"), 1.0, -float("inf")]], 2, [2, 0]),
])
def test_topk_ties_pick_the_lowest_expert(impl, logits, top_k, want) -> None:
    """Equal router probabilities go to the lower expert index, in the kernel and the torch
    reference alike: the two implementations must route every token to the same experts."""
    weights, ids = TOPK_IMPLS[impl](torch.tensor(logits), top_k, True)
    assert ids.tolist() == [want]
    assert torch.all(weights[:, :-1] >= weights[:, 1:])


def test_topk_ties_at_the_k_boundary_of_random_bf16_rows() -> None:
    """bf16 logits tie often (about 6% of random rows at E = 128, k = 8 have a tie between
    the k-th and the (k+1)-th): the kernel and the reference choose the same experts in the
    same order there, the tied ones by lowest index."""
    experts, top_k = 128, 8
    pool = torch.randn(1024, experts, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ranked = pool.float().sort(dim=-1, descending=True).values
    tied = ranked[:, top_k - 1] == ranked[:, top_k]
    assert int(tied.sum()) >= 24
    logits = torch.cat([pool[tied][:24], pool[~tied][:8]])
    weights, ids = moe_topk(logits, top_k, True)
    ref_weights, ref_ids = moe_topk_reference(logits, top_k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-6)
    for row, chosen in zip(logits.float(), ids.tolist()):
        boundary = row.sort(descending=True).values[top_k - 1]
        above = torch.nonzero(row > boundary).flatten().tolist()
        at = torch.nonzero(row == boundary).flatten().tolist()
        assert sorted(chosen) == sorted(above + at[:top_k - len(above)])


def check_layout(al: MoeAlignment, ids: torch.Tensor, experts: int) -> None:
    """The aligned layout's invariants, then its exact value (the reference)."""
    pairs, bm = ids.numel(), al.block_m
    used = int(al.num_blocks.item())
    assert al.block_expert.shape == (max_blocks(pairs, experts, bm),)
    assert al.sorted_pair_ids.shape == (al.block_expert.shape[0] * bm,)
    rows = al.sorted_pair_ids[:used * bm]
    assert sorted(rows[rows < pairs].tolist()) == list(range(pairs))          # a permutation of all pairs
    assert torch.all(rows <= pairs) and torch.all(al.sorted_pair_ids[used * bm:] == pairs)
    owners = al.block_expert[:used]
    assert torch.all(owners[1:] >= owners[:-1])                               # one segment per expert, ascending
    assert torch.all(al.block_expert[used:] == -1)
    flat = ids.reshape(-1)
    for b, e in enumerate(owners.tolist()):
        block = rows[b * bm:(b + 1) * bm]
        real = block[block < pairs].long()
        assert torch.all(flat[real] == e) and real.numel() > 0
        # Padding only at a segment's end: in the expert's last block, after its pairs.
        assert torch.all(block[:real.numel()] < pairs)
        if b + 1 < used and owners[b + 1] == e:
            assert real.numel() == bm
    ref_rows, ref_owners = moe_align_reference(ids, experts, bm)
    assert torch.equal(rows, ref_rows) and torch.equal(owners, ref_owners)


@pytest.mark.parametrize("tokens,experts,top_k,block_m,chunk", [
    (1, 8, 2, 16, None),   # decode: 2 pairs, 2 blocks
    (17, 8, 2, 16, 16),    # 34 pairs over several chunks; every-token and no-token experts
    (17, 4, 4, 16, 16),    # k = E: every expert receives every token (17 = a full block and one)
    (16, 1, 1, 16, None),  # one expert, exactly one full block
    (13, 8, 3, 32, 32),
    (150, 8, 2, 16, 16),   # 300 pairs: past ONE_PROGRAM_MAX_CHUNKS chunks, the grid by default
])
def test_align_layout(tokens, experts, top_k, block_m, chunk) -> None:
    ids = crafted_ids(tokens, experts, top_k)
    check_layout(moe_align(ids, experts, block_m, chunk=chunk), ids, experts)


@pytest.mark.parametrize("tokens,experts,top_k,block_m,chunk", [
    (17, 8, 2, 16, 16),    # 34 pairs, less than one tile; every-token and no-token experts
    (150, 8, 2, 16, 16),   # 300 pairs: two tiles and part of a third
    (200, 1, 1, 16, 16),   # one expert receives every pair, over two tiles
    (70, 4, 4, 32, 16),    # k = E, BLOCK_M 32
    (100, 8, 3, 16, 4),    # ten tiles of 32 pairs: the scan takes several steps of 4 rows
])
def test_align_grid_is_one_program(tokens, experts, top_k, block_m, chunk) -> None:
    """The grid path, forced over tiles of 8 chunks (the cases' comments) and of its
    default size, gives the reference's layout and the one program's tensors to the last
    entry."""
    ids = crafted_ids(tokens, experts, top_k)
    one = moe_align(ids, experts, block_m, chunk=chunk, one_program=True)
    for tile_chunks in (8, None):
        grid = moe_align(ids, experts, block_m, chunk=chunk, one_program=False, tile_chunks=tile_chunks)
        check_layout(grid, ids, experts)
        for name in ("sorted_pair_ids", "block_expert", "num_blocks"):
            assert torch.equal(getattr(grid, name), getattr(one, name)), name


@pytest.mark.parametrize("tokens,one_program", [(11, None), (90, True), (90, False)])
def test_align_random_ids(tokens, one_program) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)]).to(torch.int32)
    check_layout(moe_align(ids, 8, 16, chunk=16, one_program=one_program), ids, 8)


def test_grid_cases_span_several_tiles() -> None:
    """The 300-pair cases above span several grid tiles at chunk 16 and pass the one-program
    limit (the default switch) only while the constants stay about this size."""
    assert 2 * 8 * 16 < 300 and 300 > ONE_PROGRAM_MAX_CHUNKS * 16
    assert grid_tile_chunks(300, 16) == 1  # default tiles: 19 of one chunk


def test_grid_tiles_grow_with_pairs() -> None:
    """One chunk a program at decode sizes, about GRID_TILES programs above, at most
    MAX_TILE_CHUNKS chunks."""
    assert grid_tile_chunks(2048, 32) == 1
    assert grid_tile_chunks(16384, 32) == 4 and -(-16384 // (4 * 32)) == GRID_TILES
    assert grid_tile_chunks(1 << 20, 32) == MAX_TILE_CHUNKS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,inter", [
    (1, 8, 2, 16),      # decode
    (17, 4, 2, 24),     # expert 0 every token, expert 3 none; partial column and K tiles
    (5, 4, 4, 48),      # k = E
    (3, 1, 1, 16),      # k = 1: stage 2 writes the output
])
def test_fused_moe_is_reference(dtype, tokens, experts, top_k, inter) -> None:
    hidden = 32
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = crafted_ids(tokens, experts, top_k)
    weights = torch.rand(tokens, top_k, generator=gen)
    w13, w2 = expert_weights(experts, hidden, inter, dtype)
    out = fused_moe(x, w13, w2, weights, moe_align(ids, experts, 16), SMALL)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == (tokens, hidden)
    # bf16: rounding points differ by one (the weight multiply before the down rounding;
    # the interpreter truncates bf16 casts), a few ulps of 2**-8.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", [8, 64, 256])  # 4, 32 and 128 rows an expert: each of the layer's tilings
def test_layer_tiles_are_reference(tokens) -> None:
    """The tiles the layer takes by rows per expert (``default_tiles``) give the reference's
    output, blocks of 16, 64 and 128 rows."""
    hidden, experts, top_k, inter = 32, 4, 2, 16
    block_m, config = default_tiles(tokens, top_k, experts, torch.float32)
    assert block_m == {8: 16, 64: 64, 256: 128}[tokens]
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = crafted_ids(tokens, experts, top_k)
    weights = torch.rand(tokens, top_k, generator=gen)
    w13, w2 = expert_weights(experts, hidden, inter, torch.float32)
    out = fused_moe(x, w13, w2, weights, moe_align(ids, experts, block_m), config)
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), rtol=1e-4, atol=1e-4)


def test_layer_tiles_grow_with_rows_per_expert() -> None:
    """Decode batches of Qwen3-30B-A3B (128 experts, top-8) keep 16-row blocks; a prefill
    chunk takes the largest blocks of its format."""
    for dtype in (torch.bfloat16, torch.float32, FP8_DTYPE):
        assert default_tiles(256, 8, 128, dtype)[0] == 16
        assert default_tiles(8192, 8, 128, dtype)[0] == (64 if dtype == FP8_DTYPE else 128)
        sizes = [default_tiles(t, 8, 128, dtype)[0] for t in (1, 256, 512, 1024, 2048, 8192)]
        assert sizes == sorted(sizes)
    # float32 tiles fit the shared memory the pipelined 16-bit ones fill: K steps of 32
    assert {default_tiles(t, 8, 128, torch.float32)[1].block_k for t in (1, 1024, 8192)} == {32}


def test_routed_block_is_transformers_qwen3_moe() -> None:
    """Router, alignment and experts together, and the torch references, against
    transformers' own sparse MoE block in float32."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    w13, w2 = expert_weights(8, 32, 16, torch.float32, seed=1)
    router = torch.randn(8, 32)
    hf_w13, hf_w2 = _hf_expert_tensors(block)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        hf_w13.copy_(w13)  # transformers stacks them as we do: (E, 2I, H) [gate | up], (E, H, I)
        hf_w2.copy_(w2)
        x = torch.randn(7, 32)
        expected = block(x[None])[0]
    logits = F.linear(x, router)
    weights, ids = moe_topk(logits, 2, True)
    out = fused_moe(x, w13, w2, weights, moe_align(ids, 8, 16), SMALL)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    ref = fused_moe_reference(x, w13, w2, *moe_topk_reference(logits, 2, True))
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)


def _hf_expert_tensors(block: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked expert parameters of transformers' block (E, 2I, H) and (E, H, I)."""
    experts = block.experts
    if hasattr(experts, "gate_up_proj"):  # transformers 5 stacks them as we do
        return experts.gate_up_proj.data, experts.down_proj.data
    # Older transformers: a ModuleList of dense MLPs, stacked here the way the loader does.
    w13 = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]).data
    return w13, torch.stack([e.down_proj.weight for e in experts]).data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,top_k,hidden", [(3, 8, 40), (2, 3, 1100), (4, 1, 16), (0, 2, 8)])
def test_moe_sum_is_reference(dtype, tokens, top_k, hidden) -> None:
    """k a power of two or not (masked choices), H past one column block, k = 1, no tokens."""
    rows = (torch.randn(tokens * top_k, hidden, generator=torch.Generator().manual_seed(top_k)) * 4).to(dtype)
    got = moe_sum(rows, top_k)
    ref = moe_sum_reference(rows, top_k)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    # Sums of k float32 values in another order: a few float32 ulps, then one rounding.
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
    assert moe_sum(rows, top_k, out) is out
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_moe_sum_refuses_bad_arguments() -> None:
    rows = torch.zeros(6, 4)
    with pytest.raises(ValueError, match="top_k"):
        moe_sum(rows, 0)
    with pytest.raises(ValueError, match="rows"):
        moe_sum(rows, 4)
    with pytest.raises(ValueError, match="rows"):
        moe_sum(torch.zeros(8, 4)[:, ::2], 2)
    with pytest.raises(TypeError, match="rows"):
        moe_sum(rows.to(torch.int32), 2)
    with pytest.raises(ValueError, match="out"):
        moe_sum(rows, 2, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="out"):
        moe_sum(rows, 2, torch.zeros(3, 4, dtype=torch.int64))


def test_launchers_refuse_bad_arguments() -> None:
    logits = torch.randn(3, 4)
    with pytest.raises(TypeError, match="logits"):
        moe_topk(logits.double(), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_topk(logits, 5, True)
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_m"):
        moe_align(ids, 4, 8)
    with pytest.raises(TypeError, match="topk_ids"):
        moe_align(ids.long(), 4)
    x = torch.randn(3, 32)
    w13, w2 = expert_weights(4, 32, 16, torch.float32)
    weights = torch.rand(3, 2)
    al = moe_align(ids, 4)
    with pytest.raises(TypeError, match="w13"):
        fused_moe(x, w13.half(), w2, weights, al)
    with pytest.raises(ValueError, match="w13"):
        fused_moe(x, w13[:, :30], w2, weights, al)
    with pytest.raises(ValueError, match="alignment"):
        fused_moe(x[:2], w13, w2, weights[:2], al)
