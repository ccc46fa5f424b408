"""Layer unit tests: tensor-parallel weight sharding simulated on one process
(tp_size=2 ranks concatenated equal the full weight), rotary, norm, and the bf16
rounding contract: round where Hugging Face's Qwen3 rounds, keep in
float32 what it keeps in float32 (RoPE: more), eagerly and in the compiled form."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

from minivllm.config import ModelConfig
from minivllm.kernels.reference import rope_ref, silu_and_mul_ref
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
)
from minivllm.layers.norm import RMSNorm
from minivllm.layers.rotary import RotaryEmbedding
from minivllm.layers.weights import RowRuns, check_tp_divisibility
from minivllm.ops.dispatch import Ops
from minivllm.testing import TinyConfig, make_hf_model, make_model_executor, make_plan, save_hf_model

TORCH_OPS = Ops.build("torch", torch.device("cpu"), torch.float32)  # the torch references

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


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_qkv_shards_split_or_replicate_kv_heads(tp, kv_heads):
    """8 query heads over tp ranks; KV heads split (kv >= tp) or each replicated on tp // kv
    consecutive ranks, so that rank r's query heads find their GQA KV head locally."""
    heads = 8
    full = {s: torch.randn(n * D, HIDDEN) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    local_q, local_kv = heads // tp, max(1, kv_heads // tp)
    holders: dict[int, list[int]] = {h: [] for h in range(kv_heads)}
    for r in range(tp):
        layer = QKVParallelLinear(HIDDEN, D, heads, kv_heads, tp_rank=r, tp_size=tp)
        load(layer, full)
        assert (layer.num_heads, layer.num_kv_heads) == (local_q, local_kv)
        q, k, v = qkv_shards(layer)
        assert torch.equal(q, full["q"][r * local_q * D:(r + 1) * local_q * D])
        first_kv = r * local_kv if kv_heads >= tp else r // (tp // kv_heads)
        for i in range(local_kv):
            holders[first_kv + i].append(r)
        kv_rows = slice(first_kv * D, (first_kv + local_kv) * D)
        assert torch.equal(k, full["k"][kv_rows]) and torch.equal(v, full["v"][kv_rows])
        # GQA: query head h reads KV head h // (heads // kv_heads); all of rank r's do so locally.
        for h in range(r * local_q, (r + 1) * local_q):
            assert first_kv <= h // (heads // kv_heads) < first_kv + local_kv
    assert all(len(ranks) == max(1, tp // kv_heads) for ranks in holders.values()), holders


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


def tp_model_config(**kw) -> ModelConfig:
    shapes = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    return ModelConfig(**{**shapes, **kw})


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_check_tp_divisibility_accepts_split_or_replicated_kv_heads_and_any_vocab(tp):
    check_tp_divisibility(tp_model_config(), tp)  # vocab 101 is prime: padding, not an error
    check_tp_divisibility(tp_model_config(vocab_size=3), tp)


@pytest.mark.parametrize("kw,tp,field", [
    (dict(num_attention_heads=6, num_key_value_heads=6), 4, "num_attention_heads"),
    (dict(num_attention_heads=12, num_key_value_heads=3), 2, "num_kv_heads"),
    (dict(num_attention_heads=12, num_key_value_heads=3), 4, "num_kv_heads"),
    (dict(num_attention_heads=8, num_key_value_heads=4), 8, None),  # replicated: fine
    (dict(intermediate_size=90), 4, "intermediate_size"),
])
def test_check_tp_divisibility_rejects_what_layers_reject(kw, tp, field):
    cfg = tp_model_config(**kw)
    if field is None:
        check_tp_divisibility(cfg, tp)
        return
    with pytest.raises(ValueError, match=field):
        check_tp_divisibility(cfg, tp)
    with pytest.raises(ValueError):  # the layers enforce the same rule
        QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                          tp_rank=0, tp_size=tp)
        MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, tp_rank=0, tp_size=tp)


def test_check_tp_divisibility_rejects_bad_size():
    with pytest.raises(ValueError, match="tp_size"):
        check_tp_divisibility(tp_model_config(), 0)


def test_two_rank_mlp_partial_sums_equal_single_rank():
    inter, x = 8, torch.randn(5, HIDDEN)
    gate, up, down = torch.randn(inter, HIDDEN), torch.randn(inter, HIDDEN), torch.randn(HIDDEN, inter)
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    total = torch.zeros_like(want)
    for r in range(2):
        gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter], tp_rank=r, tp_size=2)
        load(gate_up, {0: gate, 1: up})
        row = RowParallelLinear(inter, HIDDEN, tp_rank=r, tp_size=2)
        load(row, {None: down})
        total += row(silu_and_mul_ref(gate_up(x)))  # what the next norm sums over ranks
    torch.testing.assert_close(total, want)


def test_row_partials_carry_the_bias_once():
    """The next norm sums the ranks' outputs, so only rank 0 adds the bias."""
    w, b, x = torch.randn(5, 8), torch.randn(5), torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for r in range(2):
        row = RowParallelLinear(8, 5, bias=True, tp_rank=r, tp_size=2)
        row.weight.weight_loader(row.weight, w)
        row.bias.weight_loader(row.bias, b)
        total += row(x.chunk(2, dim=-1)[r])
    torch.testing.assert_close(total, F.linear(x, w, b))


class CountingTensor:
    """A ``CheckpointTensor`` over a plain tensor that counts the elements read through it."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t, self.shape, self.dtype, self.numel_read = t, t.shape, t.dtype, 0

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        out = self._t.narrow(dim, start, length).clone()
        self.numel_read += out.numel()
        return out

    def read(self) -> torch.Tensor:
        self.numel_read += self._t.numel()
        return self._t.clone()


def lazy_layers(r: int, tp: int) -> list[tuple[torch.nn.Module, dict]]:
    """(layer on rank r of tp, its full checkpoint tensors by shard id) for every loader kind."""
    torch.manual_seed(0)
    return [
        (ColumnParallelLinear(HIDDEN, 8, tp_rank=r, tp_size=tp), {None: torch.randn(8, HIDDEN)}),
        (RowParallelLinear(8, HIDDEN, tp_rank=r, tp_size=tp), {None: torch.randn(HIDDEN, 8)}),
        (MergedColumnParallelLinear(HIDDEN, [8, 8], tp_rank=r, tp_size=tp),
         {0: torch.randn(8, HIDDEN), 1: torch.randn(8, HIDDEN)}),
        (QKVParallelLinear(HIDDEN, D, 4, 1, tp_rank=r, tp_size=tp),
         {"q": torch.randn(4 * D, HIDDEN), "k": torch.randn(D, HIDDEN), "v": torch.randn(D, HIDDEN)}),
        (VocabParallelEmbedding(11, HIDDEN, tp_rank=r, tp_size=tp), {None: torch.randn(11, HIDDEN)}),
        (RMSNorm(HIDDEN, 1e-6), {None: torch.randn(HIDDEN)}),
    ]


@pytest.mark.parametrize("r", [0, 1])
def test_loaders_read_only_their_slice_of_a_lazy_tensor(r):
    """Rank r of 2 reads exactly its shard (a replicated KV head and a norm whole, vocab
    padding not at all) and gets what narrowing the whole tensor gives."""
    for (lazy_layer, full), (eager_layer, _) in zip(lazy_layers(r, 2), lazy_layers(r, 2)):
        read = 0
        for shard_id, w in full.items():
            lazy = CountingTensor(w)
            lazy_layer.weight.weight_loader(lazy_layer.weight, lazy, shard_id)
            eager_layer.weight.weight_loader(eager_layer.weight, w, shard_id)
            read += lazy.numel_read
        assert torch.equal(lazy_layer.weight, eager_layer.weight), type(lazy_layer).__name__
        padding = lazy_layer.shard_size * (r + 1) - 11 if isinstance(lazy_layer, VocabParallelEmbedding) else 0
        assert read == lazy_layer.weight.numel() - max(0, padding) * HIDDEN, type(lazy_layer).__name__
        if not isinstance(lazy_layer, RMSNorm):
            assert read < sum(w.numel() for w in full.values())


def test_row_runs_read_only_the_rows_they_return():
    """Runs of a tensor's rows (Qwen3-Next's fused projections) read as those rows indexed, along
    either dim; a row narrow reads only its rows, also from inside a run; a source of other than
    the rows expected, or a narrow past the runs, is refused by name."""
    w = torch.arange(60.0).reshape(10, 6)
    runs, rows = ((6, 2), (0, 3), (8, 1)), [6, 7, 0, 1, 2, 8]
    source = CountingTensor(w)
    view = RowRuns(source, runs, 10, "t")
    assert view.shape == (6, 6) and view.dtype == w.dtype
    assert torch.equal(view.read(), w[rows])
    source.numel_read = 0
    assert torch.equal(view.narrow(0, 1, 3), w[rows[1:4]]) and source.numel_read == 3 * 6
    assert torch.equal(view.narrow(1, 2, 3), w[rows][:, 2:5])
    with pytest.raises(ValueError, match="t: expected 10 rows"):
        RowRuns(CountingTensor(w[:9]), runs, 10, "t").read()
    with pytest.raises(ValueError, match="t: cannot narrow"):
        view.narrow(0, 4, 3)


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
    assert torch.equal(TORCH_OPS.embed(torch.tensor([3, 9, 0]), emb.weight, emb.vocab_start, emb.vocab_end),
                       w[[3, 9, 0]])


def test_rotary_matches_hf_and_rejects_positions_beyond_cache():
    rope = RotaryEmbedding(D * 2, max_position=16, base=10_000.0)
    pos = torch.tensor([0, 3, 15, 7])
    q, k = torch.randn(4, 3, D * 2), torch.randn(4, 1, D * 2)
    inv = 1.0 / (10_000.0 ** (torch.arange(0, D * 2, 2, dtype=torch.float32) / (D * 2)))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    got_q, got_k = rope_ref(pos, q, k, rope.cos_sin_cache)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    with pytest.raises(ValueError, match=r"\[0, 16\).*max_position_embeddings"):
        rope.check_positions(torch.tensor([2, 16]))


def test_rms_norm_fused_residual():
    norm = RMSNorm(HIDDEN, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(HIDDEN))
    x, r = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
    s = x + r
    want = norm.weight * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    out, new_residual = TORCH_OPS.add_rms_norm(x, r, norm.weight, norm.eps)
    torch.testing.assert_close(out, want)
    assert torch.equal(new_residual, s)
    torch.testing.assert_close(TORCH_OPS.rms_norm(s, norm.weight, norm.eps), want)


# ---- bf16 numerics ----------------------------------------------------------------------------

def bf16_norms(hidden: int, seed: int = 0) -> tuple[RMSNorm, Qwen3RMSNorm]:
    """Our RMSNorm and HF's with the same weights (around 1), in bf16."""
    torch.manual_seed(seed)
    w = 1.0 + 0.2 * torch.randn(hidden)
    ours, hf = RMSNorm(hidden, eps=1e-6), Qwen3RMSNorm(hidden, eps=1e-6)
    with torch.no_grad():
        ours.weight.copy_(w)
        hf.weight.copy_(w)
    return ours.to(torch.bfloat16), hf.to(torch.bfloat16)


def test_bf16_rms_norm_and_fused_residual_round_like_hf():
    ours, hf = bf16_norms(64)
    x, r = (40 * torch.randn(5, 64)).bfloat16(), (300 * torch.randn(5, 64)).bfloat16()
    assert torch.equal(TORCH_OPS.rms_norm(x, ours.weight, ours.eps), hf(x))
    out, residual = TORCH_OPS.add_rms_norm(x, r, ours.weight, ours.eps)
    # HF: ``hidden = residual + hidden`` in bf16, then the norm (statistics in fp32).
    assert torch.equal(residual, r + x) and torch.equal(out, hf(r + x))


def test_bf16_silu_and_mul_rounds_like_hf():
    x = (4 * torch.randn(5, 2 * 48)).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul_ref(x), ACT2FN["silu"](gate) * up)


def test_bf16_rope_is_the_fp32_rotation_rounded_once():
    """HF casts cos/sin to bf16 and rotates in bf16 (4 roundings); ours keeps the table and the
    rotation in fp32 and rounds the result once, so it is closer to the float32 model."""
    d, theta, max_pos = 128, 1e6, 40960
    rope = RotaryEmbedding(d, max_pos, theta)
    pos = torch.tensor([0, 1, 17, 1000, 32768, max_pos - 1])
    q, k = torch.randn(6, 4, d).bfloat16(), torch.randn(6, 2, d).bfloat16()
    want_q, want_k = rope_ref(pos, q.float(), k.float(), rope.cos_sin_cache)
    got_q, got_k = rope_ref(pos, q, k, rope.cos_sin_cache)
    assert torch.equal(got_q, want_q.bfloat16()) and torch.equal(got_k, want_k.bfloat16())
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat([pos[:, None].float() * inv_freq] * 2, dim=-1)  # HF's angles, fp32
    hf_q, _ = apply_rotary_pos_emb(q, k, emb.cos().bfloat16(), emb.sin().bfloat16(), unsqueeze_dim=1)
    rel = lambda a: ((a.float() - want_q).norm() / want_q.norm()).item()  # noqa: E731
    assert rel(got_q) < rel(hf_q)


def test_bf16_model_loses_no_more_than_hf(tmp_path):
    """The whole bf16 forward on the CPU, embedding to logits, against float32 on the same
    bf16-valued weights (std 0.1): ours within 10% of HF's own bf16 error (measured:
    ``docs/tuning.md``, "Rounding and precision")."""
    cfg = TinyConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=128, rope_theta=1e6)
    hf32 = make_hf_model(cfg, seed=0, std=0.1)
    with torch.no_grad():
        for p in hf32.parameters():
            p.copy_(p.bfloat16().float())
    path = save_hf_model(hf32, tmp_path / "ckpt")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 96).tolist()
    ours = {}
    for dtype in ("float32", "bfloat16"):
        ex = make_model_executor(path, device="cpu", dtype=dtype, kernels="torch", block_size=16,
                                 num_blocks=8, max_num_seqs=1, max_num_batched_tokens=128)
        batch, inputs = ex.prepare(make_plan([(tokens, 0, tuple(range(6)), True)], 16))
        ours[dtype] = ex.model.compute_logits(ex.run_model(batch, inputs)).float()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    with torch.no_grad():
        ref, theirs = (m(torch.tensor([tokens])).logits[0].float() for m in (hf32, hf16))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(ours["float32"], ref) < 1e-5
    assert rel(ours["bfloat16"], ours["float32"]) <= 1.1 * rel(theirs, ref)


def test_teacher_forced_flip_measure_compares_each_side_with_its_own_float32(tmp_path):
    """The measure ``tests_gpu/test_bf16_accuracy.py`` asserts on, run through on the CPU at
    tiny shapes: both sides' bf16 really ran in bf16 (a nonzero logits error), counted over
    every (step, prompt) position."""
    from minivllm.testing import SMOKE_SHAPES, make_bf16_checkpoint, random_prompts, teacher_forced_flips

    hf32 = make_bf16_checkpoint(str(tmp_path), 0.1, device="cpu", **SMOKE_SHAPES)  # two layers
    prompts = random_prompts(2, 8, SMOKE_SHAPES["vocab_size"])
    got = teacher_forced_flips(str(tmp_path), hf32, prompts, steps=3, device="cpu")
    for side in ("ours", "hf"):
        stats = got[side]
        assert 0 < stats["logits_rel"] < 0.2, (side, stats)
        assert 0 <= stats["outside_top5"] <= stats["flip"] <= 1, (side, stats)
        assert stats["flip"] * 8 == round(stats["flip"] * 8), (side, stats)  # 4 steps x 2 prompts
