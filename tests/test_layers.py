"""Layer unit tests: tensor-parallel weight sharding simulated on one process
(tp_size=2 ranks concatenated equal the full weight), rotary, norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

from minivllm.layers.activation import SiluAndMul
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding

HIDDEN, D = 12, 4


def load(layer, shards: dict) -> torch.Tensor:
    for shard_id, w in shards.items():
        layer.weight.weight_loader(layer.weight, w, shard_id)
    return layer.weight.detach()


def qkv_shards(layer: QKVParallelLinear) -> tuple[torch.Tensor, ...]:
    q, kv = layer.num_heads * D, layer.num_kv_heads * D
    return tuple(layer.weight.detach().split([q, kv, kv]))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 2)])
def test_qkv_two_ranks_concatenate_to_full_on_head_boundaries(heads, kv_heads):
    full = {s: torch.randn(n * D, HIDDEN) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    ranks = [QKVParallelLinear(HIDDEN, D, heads, kv_heads, tp_rank=r, tp_size=2) for r in range(2)]
    for layer in ranks:
        load(layer, full)
        assert layer.num_heads == heads // 2 and layer.num_kv_heads == kv_heads // 2
    parts = [qkv_shards(layer) for layer in ranks]
    for i, s in enumerate("qkv"):
        assert torch.equal(torch.cat([parts[0][i], parts[1][i]]), full[s])
    single = QKVParallelLinear(HIDDEN, D, heads, kv_heads)
    assert torch.equal(load(single, full), torch.cat([full["q"], full["k"], full["v"]]))


def test_qkv_replicates_kv_heads_when_fewer_than_ranks():
    full = {"q": torch.randn(4 * D, HIDDEN), "k": torch.randn(2 * D, HIDDEN), "v": torch.randn(2 * D, HIDDEN)}
    ranks = [QKVParallelLinear(HIDDEN, D, 4, 2, tp_rank=r, tp_size=4) for r in range(4)]
    for r, layer in enumerate(ranks):
        load(layer, full)
        q, k, v = qkv_shards(layer)
        assert torch.equal(q, full["q"][r * D:(r + 1) * D])
        assert torch.equal(k, full["k"][(r // 2) * D:(r // 2 + 1) * D])
        assert torch.equal(v, full["v"][(r // 2) * D:(r // 2 + 1) * D])


@pytest.mark.parametrize("heads,kv_heads,tp", [(6, 6, 4), (4, 3, 2), (8, 3, 2), (4, 4, 3)])
def test_qkv_non_divisible_heads_raise(heads, kv_heads, tp):
    with pytest.raises(ValueError, match="tp_size"):
        QKVParallelLinear(HIDDEN, D, heads, kv_heads, tp_rank=0, tp_size=tp)


def test_qkv_wrong_shape_raises_naming_the_shard():
    layer = QKVParallelLinear(HIDDEN, D, 4, 2)
    with pytest.raises(ValueError, match=r"QKVParallelLinear shard 'k'.*\(8, 12\).*\(16, 12\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(16, HIDDEN), "k")
    with pytest.raises(ValueError, match="shard id"):
        layer.weight.weight_loader(layer.weight, torch.randn(8, HIDDEN), None)


def test_two_rank_mlp_partial_sums_equal_single_rank():
    inter, x = 8, torch.randn(5, HIDDEN)
    gate, up, down = torch.randn(inter, HIDDEN), torch.randn(inter, HIDDEN), torch.randn(HIDDEN, inter)
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    total = torch.zeros_like(want)
    for r in range(2):
        gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter], tp_rank=r, tp_size=2)
        load(gate_up, {0: gate, 1: up})
        row = RowParallelLinear(inter, HIDDEN, tp_rank=r, tp_size=2, reduce_results=False)
        load(row, {None: down})
        total += row(SiluAndMul()(gate_up(x)))  # what all_reduce would sum
    torch.testing.assert_close(total, want)


def test_column_and_row_shards_concatenate_to_full():
    w = torch.randn(6, HIDDEN)
    cols = [load(ColumnParallelLinear(HIDDEN, 6, tp_rank=r, tp_size=2), {None: w}) for r in range(2)]
    assert torch.equal(torch.cat(cols), w)
    rows = [load(RowParallelLinear(HIDDEN, 6, tp_rank=r, tp_size=2), {None: w}) for r in range(2)]
    assert [r.shape for r in rows] == [(6, 6), (6, 6)]
    assert torch.equal(torch.cat(rows, dim=1), w)


def test_single_rank_is_a_checked_copy():
    layer = ColumnParallelLinear(HIDDEN, 6)
    w = torch.randn(6, HIDDEN)
    assert torch.equal(load(layer, {None: w}), w)
    with pytest.raises(ValueError, match=r"ColumnParallelLinear.*\(6, 12\).*\(6, 11\)"):
        load(layer, {None: torch.randn(6, 11)})
    with pytest.raises(ValueError, match="divisible"):
        ColumnParallelLinear(HIDDEN, 7, tp_rank=0, tp_size=2)


def test_vocab_sharding_pads_last_rank():
    w = torch.randn(10, HIDDEN)
    shards = [load(VocabParallelEmbedding(10, HIDDEN, tp_rank=r, tp_size=3), {None: w}) for r in range(3)]
    assert [s.shape[0] for s in shards] == [4, 4, 4]
    assert torch.equal(torch.cat(shards)[:10], w) and not torch.cat(shards)[10:].any()
    head = ParallelLMHead(10, HIDDEN)
    load(head, {None: w})
    h = torch.randn(3, HIDDEN)
    torch.testing.assert_close(head(h), h @ w.T)
    emb = VocabParallelEmbedding(10, HIDDEN)
    load(emb, {None: w})
    assert torch.equal(emb(torch.tensor([3, 9, 0])), w[[3, 9, 0]])


def test_rotary_matches_hf_and_rejects_positions_beyond_cache():
    rope = RotaryEmbedding(D * 2, max_position=16, base=10_000.0)
    pos = torch.tensor([0, 3, 15, 7])
    q, k = torch.randn(4, 3, D * 2), torch.randn(4, 1, D * 2)
    inv = 1.0 / (10_000.0 ** (torch.arange(0, D * 2, 2, dtype=torch.float32) / (D * 2)))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    got_q, got_k = rope(pos, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    with pytest.raises(ValueError, match=r"\[0, 16\).*max_position_embeddings"):
        rope(torch.tensor([2, 16]), q[:2], k[:2])


def test_rms_norm_fused_residual():
    norm = RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN))
    x, r = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    s = x + r
    want = norm.weight * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    out, new_residual = norm(x, r)
    torch.testing.assert_close(out, want)
    assert torch.equal(new_residual, s)
    torch.testing.assert_close(norm(s), want)
