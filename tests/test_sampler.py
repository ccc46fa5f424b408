"""The torch sampler: greedy == argmax, filters never leak, seeds are batch-independent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.layers.sampler import Sampler, SamplingTensors, hashed_uniform, row_key
from minivllm.sampling import SamplingParams

params_st = st.builds(
    SamplingParams,
    temperature=st.just(0.0) | st.floats(0.05, 3.0),
    top_k=st.integers(-1, 45),
    top_p=st.just(1.0) | st.floats(0.01, 1.0),
    min_p=st.just(0.0) | st.floats(0.0, 1.0),
    seed=st.none() | st.integers(-(2 ** 63), 2 ** 64),
)


def make_logits(seed: int, rows: int, vocab: int, scale: float, ties: bool) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, vocab)) * scale
    if ties:  # few distinct values: many ties at the top-k / top-p boundaries
        x = np.round(x)
    return torch.tensor(x, dtype=torch.float32)


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int] | None = None,
           gen_seed: int = 0) -> torch.Tensor:
    positions = positions if positions is not None else list(range(len(params)))
    t = SamplingTensors.build(params, positions, logits.shape[1], "cpu")
    return Sampler(torch.Generator().manual_seed(gen_seed))(logits, t)


def definitely_excluded(row: torch.Tensor, p: SamplingParams) -> np.ndarray:
    """Tokens that top-k / top-p / min-p exclude beyond any float rounding doubt (bool (V,))."""
    z = (row / p.temperature).double().numpy()  # same float32 division as the sampler
    v = len(z)
    k = p.top_k if 0 < p.top_k < v else v
    top = np.sort(z)[::-1][:k]           # the kept multiset of values is unique even with ties
    excluded = z < top[-1]
    if p.top_p < 1:
        w = np.exp(top - top[0])
        w /= w.sum()
        mass_above = np.array([w[top > zi].sum() for zi in z])
        excluded |= mass_above > p.top_p + 1e-4
    if p.min_p > 0:
        excluded |= z < z.max() + math.log(p.min_p) - 1e-4
    return excluded


@settings(max_examples=60, deadline=None)
@given(st.lists(params_st, min_size=1, max_size=5), st.integers(2, 40), st.integers(0, 2 ** 32 - 1),
       st.floats(0.1, 20.0), st.booleans())
def test_excluded_tokens_never_emitted_and_greedy_is_argmax(params, vocab, seed, scale, ties):
    repeats = 16  # each row sampled many times (distinct positions, so distinct seeded draws)
    logits = make_logits(seed, len(params), vocab, scale, ties).repeat_interleave(repeats, dim=0)
    rows = [p for p in params for _ in range(repeats)]
    tokens = sample(logits, rows, gen_seed=seed).tolist()
    argmax = logits.argmax(dim=-1).tolist()
    for i, (p, tok) in enumerate(zip(rows, tokens)):
        if p.temperature == 0:
            assert tok == argmax[i]
        else:
            assert not definitely_excluded(logits[i], p)[tok], (p, logits[i].tolist(), tok)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(2, 30))
def test_top_k_one_and_tiny_top_p_are_argmax(seed, vocab):
    logits = make_logits(seed, 2, vocab, 3.0, ties=False)
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6, seed=seed)]
    assert sample(logits, params).tolist() == logits.argmax(dim=-1).tolist()


def test_seeded_rows_are_batch_independent():
    vocab = 50
    target = make_logits(7, 1, vocab, 1.0, ties=False)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = [int(sample(target, [p], positions=[pos])[0]) for pos in range(20)]
    others = make_logits(8, 3, vocab, 2.0, ties=False)
    mixed = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=9)]
    for pos in range(20):
        batch = torch.cat([others[:2], target, others[2:]])
        got = sample(batch, mixed[:2] + [p] + mixed[2:], positions=[3, 4, pos, 5], gen_seed=pos)
        assert int(got[2]) == alone[pos]
    assert len(set(alone)) > 1  # different positions draw different numbers


def test_unseeded_rows_follow_the_generator():
    logits = make_logits(3, 8, 30, 1.0, ties=False)
    params = [SamplingParams(temperature=1.0)] * 8
    assert torch.equal(sample(logits, params, gen_seed=5), sample(logits, params, gen_seed=5))


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_frequencies_match_softmax(seeded):
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 6000
    logits = probs.log().expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0, seed=42 if seeded else None)] * n
    counts = torch.bincount(sample(logits, params, positions=list(range(n))), minlength=5).double()
    assert torch.allclose(counts / n, probs.double(), atol=0.02), counts / n


def test_temperature_sharpens():
    logits = torch.tensor([[1.0, 0.0, -1.0]]).expand(4000, -1).contiguous()
    cold = sample(logits, [SamplingParams(temperature=0.2)] * 4000)
    hot = sample(logits, [SamplingParams(temperature=5.0)] * 4000)
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_hashed_uniform_is_open_interval_and_spread():
    keys = torch.tensor([row_key(s, pos) for s in range(4) for pos in range(4)], dtype=torch.int64)
    u = hashed_uniform(keys, 4096)
    assert 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert len({tuple(r[:8].tolist()) for r in u}) == 16


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"temperature": "1"}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_p": -0.2}, {"top_p": float("nan")},
    {"top_k": -2}, {"min_p": 1.5},
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
