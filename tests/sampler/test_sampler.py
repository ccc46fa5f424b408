"""The sampler: greedy == argmax, filters never leak and keep what they should, seeds are
batch-independent, the fused kernel (TRITON_INTERPRET=1 here) matches its torch reference,
and nothing on the sampling path reads a device value on the host.

Edge settings are tested on both sides of each edge (a planted bug once made top_k=0 keep
nothing, min_p=1 mask everything and tiny temperatures stop being greedy while the suite
passed). Noise is a fixed hash of (key, vocab index), so every test here is deterministic.
"""

from __future__ import annotations

import dataclasses
import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from minivllm.kernels.gumbel_sample import (  # noqa: E402
    gumbel_best, gumbel_best_reference, gumbel_pairs, gumbel_sample, gumbel_sample_reference, step_key,
)
from minivllm.ops.dispatch import Ops  # noqa: E402
from minivllm.sampler import sampler as sampler_mod  # noqa: E402
from minivllm.sampler.sampler import (  # noqa: E402
    Sampler, SamplingTensors, apply_filters, filter_floor, hashed_uniform, pick_candidate, reference_sample,
    row_key, row_keys,
)
from minivllm.sampling import GREEDY_TEMPERATURE, SamplingParams  # noqa: E402

# The two implementations of every sampling op: the torch references and the Triton kernels
# (under the interpreter on the CPU).
OPS = {"torch": Ops.build("torch", torch.device("cpu"), torch.float32),
       "kernel": Ops.build("triton", torch.device("cpu"), torch.float32)}


BACKENDS = ["torch", "kernel"]  # the Sampler's torch path (CPU default) and the Triton kernel

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
           gen_seed: int = 0, backend: str = "torch") -> torch.Tensor:
    positions = positions if positions is not None else list(range(len(params)))
    t = SamplingTensors.build(params, positions, logits.shape[1], "cpu")
    return Sampler(OPS[backend], torch.Generator().manual_seed(gen_seed))(logits, t)


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


# ----------------------------------------------------------------------------- greedy rule, build

@pytest.mark.parametrize("temperature,greedy", [
    (0.0, True), (1e-6, True), (9.9e-6, True), (GREEDY_TEMPERATURE, False), (1e-4, False), (1.0, False),
])
def test_greedy_is_one_rule(temperature, greedy):
    p = SamplingParams(temperature=temperature)
    assert p.greedy is greedy
    t = SamplingTensors.build([p, SamplingParams(temperature=0.5)], [0, 0], 10, "cpu")
    assert t.greedy.tolist() == [greedy, False]
    assert t.all_greedy is False


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(-(2 ** 63), 2 ** 65), st.integers(0, 2 ** 40)), min_size=1, max_size=6))
def test_vectorised_row_keys_match_row_key(rows):
    seeds = np.array([s & (2 ** 64 - 1) for s, _ in rows], dtype=np.uint64)
    got = row_keys(seeds, np.array([pos for _, pos in rows], dtype=np.int64))
    assert got.tolist() == [list(row_key(s, pos)) for s, pos in rows]


def test_build_is_one_buffer_with_host_flags():
    v = 100
    params = [SamplingParams(temperature=0.0, top_k=3, seed=5),   # greedy: filters and seed ignored
              SamplingParams(temperature=0.7, top_k=7, seed=-1),
              SamplingParams(temperature=1.0, top_p=0.5, top_k=20),
              SamplingParams(temperature=2.0, min_p=0.25)]
    t = SamplingTensors.build(params, np.array([4, 9, 2, 3], dtype=np.int32), v, "cpu")
    tensors = [t.temperature, t.top_k, t.top_p, t.log_min_p, t.greedy, t.seeded, t.seed_keys, t.seeded_rows]
    assert len({x.untyped_storage().data_ptr() for x in tensors}) == 1  # one host->device copy
    assert t.temperature.tolist() == [1.0, pytest.approx(0.7), 1.0, 2.0]
    assert t.top_k.tolist() == [v, 7, 20, v]
    assert t.top_p.tolist() == [math.inf, math.inf, 0.5, math.inf]
    assert t.log_min_p.tolist() == [-math.inf, -math.inf, -math.inf, pytest.approx(math.log(0.25))]
    assert t.greedy.tolist() == [True, False, False, False]
    assert t.seeded.tolist() == [False, True, False, False] and t.seeded_rows.tolist() == [1]
    assert t.seed_keys.tolist() == [[0, 0], list(row_key(-1, 9)), [0, 0], [0, 0]]
    assert (t.all_greedy, t.any_top_k, t.any_top_p, t.any_min_p) == (False, True, True, True)
    assert t.num_candidates == 20


@pytest.mark.parametrize("params,expected", [
    ([SamplingParams(min_p=0.1), SamplingParams(temperature=0, top_k=5, top_p=0.5)], 0),
    ([SamplingParams(top_k=50), SamplingParams(top_k=3, top_p=0.9)], 50),
    ([SamplingParams(top_k=50), SamplingParams(top_p=0.9)], 5000),          # top-p without top-k: sort
    ([SamplingParams(top_k=sampler_mod.MAX_CANDIDATES + 1)], 5000),         # too many candidates: sort
])
def test_num_candidates(params, expected):
    assert SamplingTensors.build(params, [0] * len(params), 5000, "cpu").num_candidates == expected


def test_build_rejects_mismatched_positions_and_handles_empty():
    with pytest.raises(ValueError, match="positions"):
        SamplingTensors.build([SamplingParams()], [1, 2], 10, "cpu")
    t = SamplingTensors.build([], [], 10, "cpu")
    assert t.all_greedy and t.seed_keys.shape == (0, 2)
    assert Sampler(OPS["torch"])(torch.zeros(0, 10), t).shape == (0,)


# ----------------------------------------------------------------------------- filters

@settings(max_examples=60, deadline=None)
@given(st.lists(params_st, min_size=1, max_size=5), st.integers(2, 40), st.integers(0, 2 ** 32 - 1),
       st.booleans())
def test_filter_floor_keeps_what_apply_filters_keeps(params, vocab, seed, full_sort):
    logits = make_logits(seed, len(params), vocab, 3.0, ties=False)  # tie-free: both rules agree exactly
    t = SamplingTensors.build(params, [0] * len(params), vocab, "cpu")
    if full_sort and t.num_candidates:
        t = dataclasses.replace(t, num_candidates=vocab)
    floor = filter_floor(logits, t)
    fast = logits >= floor[:, None] if floor is not None else torch.ones_like(logits, dtype=torch.bool)
    ref = apply_filters(logits / t.temperature[:, None], t) > -math.inf
    random_rows = ~t.greedy
    assert torch.equal(fast[random_rows], ref[random_rows]), (params, logits)


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
        if p.greedy:
            assert tok == argmax[i]
        else:
            assert not definitely_excluded(logits[i], p)[tok], (p, logits[i].tolist(), tok)


# ----------------------------------------------------------------------------- edges, both sides

FLAT = 8  # vocab of the edge batch


def _edge_cases() -> dict[str, tuple[SamplingParams, list[float]]]:
    flat = [0.0] * FLAT
    distinct = [0.3, 2.0, -1.0, 1.1, 0.0, -0.5, 1.7, -2.0]              # argmax 1, then 6, 3
    quarter = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)] + [-1e4] * 4  # probs 0.4 / 0.3 / 0.2 / 0.1
    return {
        "top_k=0": (SamplingParams(top_k=0), flat),
        "top_k=-1": (SamplingParams(top_k=-1), flat),
        "top_k>V": (SamplingParams(top_k=FLAT + 5), flat),
        "top_k=1": (SamplingParams(top_k=1, temperature=2.0), distinct),
        "top_k=2": (SamplingParams(top_k=2, temperature=50.0), distinct),
        "min_p=1": (SamplingParams(min_p=1.0), [3.0, 1.0, 3.0, 2.9] + [0.0] * 4),
        "min_p=0": (SamplingParams(min_p=0.0), flat),
        "min_p=0.6": (SamplingParams(min_p=0.6), quarter),
        "T=1e-6": (SamplingParams(temperature=1e-6), flat),
        "T=1e-6 distinct": (SamplingParams(temperature=1e-6), distinct),
        "T=1e-4": (SamplingParams(temperature=1e-4), flat),
        "top_p=1": (SamplingParams(top_p=1.0), flat),
        "top_p tiny": (SamplingParams(top_p=1e-6, temperature=3.0), distinct),
        "top_p=0.5": (SamplingParams(top_p=0.5), quarter),
        "top_k=3 top_p=0.6": (SamplingParams(top_k=3, top_p=0.6), quarter),  # 0.4/0.9 < 0.6 <= 0.7/0.9
    }


DRAWS = 16  # per edge case; the kernel runs one interpreted program per draw


@pytest.fixture(scope="module", params=BACKENDS)
def edge_draws(request) -> dict[str, set[int]]:
    """Every edge case sampled DRAWS times in one batch: name -> set of tokens drawn."""
    cases = _edge_cases()
    params = [p for p, _ in cases.values() for _ in range(DRAWS)]
    logits = torch.tensor([row for _, row in cases.values() for _ in range(DRAWS)], dtype=torch.float32)
    tokens = sample(logits, params, backend=request.param).view(len(cases), DRAWS).tolist()
    return {name: set(row) for name, row in zip(cases, tokens)}


@pytest.mark.parametrize("name", ["top_k=0", "top_k=-1", "top_k>V", "min_p=0", "top_p=1", "T=1e-4"])
def test_disabled_filters_and_small_temperatures_keep_the_whole_vocab(edge_draws, name):
    assert len(edge_draws[name]) >= FLAT - 2 and edge_draws[name] - {0, 1, 2}, edge_draws[name]


@pytest.mark.parametrize("name,expected", [
    ("top_k=1", {1}), ("top_p tiny", {1}), ("T=1e-6", {0}), ("T=1e-6 distinct", {1}),
    ("min_p=1", {0, 2}),                       # exactly the max tokens (a tie), not 2.9
    ("top_k=2", {1, 6}), ("min_p=0.6", {0, 1}), ("top_p=0.5", {0, 1}), ("top_k=3 top_p=0.6", {0, 1}),
])
def test_active_filters_keep_exactly_their_set(edge_draws, name, expected):
    assert edge_draws[name] == expected


# Min-p keeps p >= min_p * p_max of softmax(logits / T): raw logits >= max + T * log(min_p).
# Groups of equal logits whose kept set moves with T (min_p 0.3, T * log(min_p) = -0.60 at
# T = 0.5, -1.20 at T = 1, -2.41 at T = 2); a floor that ignored T would keep the T = 1 set.
MIN_P = 0.3
MIN_P_LOGITS = [0.0] + [-0.3] * 3 + [-0.9] * 6 + [-1.8] * 3 + [-3.0] * 3
MIN_P_KEPT = {  # temperature -> the raw logits that stay
    0.5: {0.0, -0.3},
    1.0: {0.0, -0.3, -0.9},
    2.0: {0.0, -0.3, -0.9, -1.8},
}
MIN_P_DRAWS = 128  # per temperature; every kept token is drawn (seeded, so always the same draws)


def test_min_p_fixture_sets_depend_on_temperature():
    """Guards the test below: each kept set differs from the one a T-blind floor keeps."""
    for temperature, kept in MIN_P_KEPT.items():
        floor = max(MIN_P_LOGITS) + temperature * math.log(MIN_P)
        assert kept == {z for z in MIN_P_LOGITS if z >= floor}
        assert min(abs(z - floor) for z in MIN_P_LOGITS) > 0.05  # far from float rounding
    assert MIN_P_KEPT[0.5] != MIN_P_KEPT[1.0] != MIN_P_KEPT[2.0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.5, 2.0])
@pytest.mark.parametrize("top_k", [-1, len(MIN_P_LOGITS) - 1], ids=["min-p-only", "with-top-k"])
def test_min_p_floor_is_on_temperature_scaled_probabilities(backend, temperature, top_k):
    """The kept set, as the floor, the reference filters and the support of seeded draws see it."""
    params = [SamplingParams(temperature=temperature, min_p=MIN_P, top_k=top_k, seed=i) for i in range(MIN_P_DRAWS)]
    logits = torch.tensor([MIN_P_LOGITS] * MIN_P_DRAWS)
    kept = {i for i, z in enumerate(MIN_P_LOGITS) if z in MIN_P_KEPT[temperature]}
    t = SamplingTensors.build(params, list(range(MIN_P_DRAWS)), len(MIN_P_LOGITS), "cpu")
    assert t.any_min_p and t.num_candidates == (0 if top_k < 0 else top_k)  # both floor paths
    floor = filter_floor(logits, t)
    assert set(torch.nonzero(logits[0] >= floor[0]).flatten().tolist()) == kept
    reference = apply_filters(logits / t.temperature[:, None], t)
    assert set(torch.nonzero(reference[0] > -math.inf).flatten().tolist()) == kept
    assert set(sample(logits, params, backend=backend).tolist()) == kept


def test_top_k_one_and_tiny_top_p_are_argmax_on_random_logits():
    logits = make_logits(11, 40, 30, 3.0, ties=False)
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6, seed=3)] * 20
    assert sample(logits, params).tolist() == logits.argmax(dim=-1).tolist()


# ----------------------------------------------------------------------------- seeds, randomness

@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_rows_are_batch_independent(backend):
    vocab = 50
    target = make_logits(7, 1, vocab, 1.0, ties=False)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = sample(target.expand(12, -1).contiguous(), [p] * 12, positions=list(range(12)), backend=backend)
    others = make_logits(8, 3, vocab, 2.0, ties=False)
    mixed = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(seed=9, top_k=5)]
    for pos in range(0, 12, 3):
        batch = torch.cat([others[:2], target, others[2:]])
        got = sample(batch, mixed[:2] + [p] + mixed[2:], positions=[3, 4, pos, 5], gen_seed=pos, backend=backend)
        assert int(got[2]) == int(alone[pos])
    assert len(set(alone.tolist())) > 1  # different positions draw different numbers


def test_seeded_rows_match_the_previous_torch_sampler():
    """Kernel, new torch path and the old reference sampler agree token for token on seeded rows."""
    logits = make_logits(5, 24, 300, 2.0, ties=False)
    kinds = [dict(), dict(top_k=20), dict(top_k=40, top_p=0.8), dict(min_p=0.1), dict(top_p=0.7)]
    params = [SamplingParams(temperature=0.3 + 0.1 * i, seed=1000 + i, **kinds[i % len(kinds)]) for i in range(24)]
    t = SamplingTensors.build(params, list(range(24)), 300, "cpu")
    old = reference_sample(logits, t, torch.Generator().manual_seed(0))
    assert torch.equal(Sampler(OPS["torch"])(logits, t), old)
    assert torch.equal(Sampler(OPS["kernel"])(logits, t), old)


def test_unseeded_rows_follow_the_generator_and_the_step():
    logits = make_logits(3, 8, 30, 1.0, ties=False)
    t = SamplingTensors.build([SamplingParams(temperature=1.0)] * 8, [0] * 8, 30, "cpu")
    a, b = (Sampler(OPS["torch"], torch.Generator().manual_seed(5)) for _ in range(2))
    first, second = a(logits, t), a(logits, t)
    assert torch.equal(first, b(logits, t)) and torch.equal(second, b(logits, t))
    assert not torch.equal(first, second)  # the default step seed advances per call
    assert torch.equal(a(logits, t, step_seed=77), b(logits, t, step_seed=77))
    assert not torch.equal(Sampler(OPS["torch"], torch.Generator().manual_seed(6))(logits, t), first)


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_frequencies_match_softmax(seeded):
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 6000
    logits = probs.log().expand(n, -1).contiguous()
    params = [SamplingParams(temperature=1.0, seed=42 if seeded else None)] * n
    counts = torch.bincount(sample(logits, params, positions=list(range(n))), minlength=5).double()
    assert torch.allclose(counts / n, probs.double(), atol=0.02), counts / n


def test_kernel_frequencies_match_softmax_chi_square():
    probs = np.array([0.45, 0.3, 0.15, 0.1])
    temperature, n = 0.6, 120
    logits = torch.tensor(np.log(probs) * temperature, dtype=torch.float32).expand(n, -1).contiguous()
    params = [SamplingParams(temperature=temperature, seed=7 if i % 2 else None) for i in range(n)]
    counts = np.bincount(sample(logits, params, backend="kernel").numpy(), minlength=4)
    chi2 = ((counts - n * probs) ** 2 / (n * probs)).sum()
    assert chi2 < 16.27, (chi2, counts)  # df 3, p = 0.001


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


# ----------------------------------------------------------------------------- kernel vs reference

def _kernel_inputs(dtype: torch.dtype, rows: int, vocab: int, ties: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(seed, rows, vocab, 3.0, ties).to(dtype)
    temperature = torch.rand(rows, generator=gen) + 0.2
    floor = logits.float().amax(dim=1) - 2.0 * torch.rand(rows, generator=gen)
    floor = torch.where(torch.rand(rows, generator=gen) < 0.4, -math.inf, floor)
    greedy = torch.arange(rows) % 4 == 0
    seeded = torch.arange(rows) % 3 == 1
    keys = torch.randint(0, 2 ** 32, (rows, 2), generator=gen) * seeded[:, None]
    return logits, temperature, floor, greedy, seeded, keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab,splits", [(37, 1), (300, 3)])
def test_kernel_matches_reference(dtype, vocab, splits):
    args = _kernel_inputs(dtype, 6, vocab, ties=False, seed=vocab)
    for floor in (args[2], None):
        got = gumbel_sample(*args[:2], floor, *args[3:], step_seed=2 ** 40 + 3, num_splits=splits)
        assert torch.equal(got, gumbel_sample_reference(*args[:2], floor, *args[3:], step_seed=2 ** 40 + 3))


@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_greedy_ties_take_the_first_index(splits):
    logits, temperature, _, _, seeded, keys = _kernel_inputs(torch.float32, 6, 300, ties=True, seed=1)
    logits[2] = 0.0  # one row tied everywhere
    greedy = torch.ones(6, dtype=torch.bool)
    got = gumbel_sample(logits, temperature, None, greedy, seeded, keys, 0, num_splits=splits)
    assert got.tolist() == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize("splits", [1, 5])
def test_one_launch_writes_global_pairs_and_leaves_its_counters_at_zero(splits):
    """The split programs of a row meet on its counter; the last one writes the winner and
    zeroes the counter, so one buffer serves launch after launch (the Sampler keeps one)."""
    logits, temperature, floor, greedy, seeded, keys = _kernel_inputs(torch.bfloat16, 6, 300, ties=True, seed=7)
    counts = torch.zeros(8, dtype=torch.int32)
    for offset in (0, 1000, 1000):
        pairs = gumbel_pairs(logits, temperature, None, greedy, seeded, keys, 99, col_offset=offset,
                             num_splits=splits, counts=counts)
        assert counts.eq(0).all()
        value, col = gumbel_best_reference(logits, temperature, None, greedy, seeded, keys, 99, col_offset=offset)
        assert torch.equal(pairs[:, 0], value) and torch.equal(pairs[:, 1], (col + offset).float())
        value, local = gumbel_best(logits, temperature, floor, greedy, seeded, keys, 99, col_offset=offset,
                                   num_splits=splits, counts=counts)
        want = gumbel_best_reference(logits, temperature, floor, greedy, seeded, keys, 99, col_offset=offset)
        assert torch.equal(value, want[0]) and torch.equal(local, want[1]) and counts.eq(0).all()


# ----------------------------------------------------------------------------- vocab shards (TP)

def shards_of(vocab: int, world: int) -> list[tuple[int, int]]:
    """[start, end) per rank, as the vocab-parallel LM head cuts the vocabulary."""
    size = -(-vocab // world)
    return [(min(vocab, r * size), min(vocab, (r + 1) * size)) for r in range(world)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mix", ["greedy", "mixed", "random"])
def test_sampling_from_vocab_shards_equals_sampling_the_gathered_row(backend, world, mix):
    """Ranks simulated in one process: each rank's best (value, global column) of its shard,
    then the pick over ranks, gives the token the whole row gives. Ties straddle the shard
    borders (the smallest index must win), greedy, seeded and unseeded rows share a batch."""
    vocab, rows = 301, 9
    logits = make_logits(3, rows, vocab, 2.0, ties=True)  # rounded: many ties
    logits[0] = 0.0  # a row tied everywhere: column 0 must win
    temps = {"greedy": [0.0] * rows, "random": [0.7, 1.0, 1.5] * 3, "mixed": [0.0, 0.8, 1.3] * 3}[mix]
    params = [SamplingParams(temperature=t, seed=(i if i % 2 else None)) for i, t in enumerate(temps)]
    t = SamplingTensors.build(params, list(range(10, 10 + rows)), vocab, "cpu")
    sampler = Sampler(OPS[backend])
    want = sampler(logits, t, step_seed=1234)
    pairs = torch.stack([sampler.shard_candidates(logits[:, a:b].contiguous(), t, a, 1234)
                         for a, b in shards_of(vocab, world)])
    assert torch.equal(pick_candidate(pairs), want)
    if mix != "greedy":  # the noise is keyed by the global column: an offset left out changes draws
        wrong = torch.stack([sampler.shard_candidates(logits[:, a:b].contiguous(), t, 0, 1234)
                             for a, b in shards_of(vocab, world)])
        assert not torch.equal(pick_candidate(wrong), want)


def test_filtering_rows_are_refused_on_shards():
    logits = make_logits(0, 2, 50, 1.0, ties=False)
    for p in (SamplingParams(top_k=5), SamplingParams(top_p=0.5), SamplingParams(min_p=0.1)):
        t = SamplingTensors.build([p, SamplingParams()], [0, 0], 50, "cpu")
        assert not t.vocab_parallel_ok
        with pytest.raises(ValueError, match="whole logits row"):
            Sampler(OPS["torch"]).shard_candidates(logits, t, 0, 1)
    with pytest.raises(ValueError, match="col_offset|columns"):
        gumbel_best(logits, torch.ones(2), None, torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool),
                    torch.zeros(2, 2, dtype=torch.int64), 1, col_offset=-1)


def test_step_key_halves_stay_int32():
    for seed in (0, 2 ** 31, 2 ** 62 - 1, 2 ** 64 - 1, -1):
        assert all(0 <= h < 2 ** 31 for h in step_key(seed))


@pytest.mark.parametrize("change,error,field", [
    (dict(logits=torch.zeros(2, 5, dtype=torch.int64)), TypeError, "logits"),
    (dict(logits=torch.zeros(2, 10)[:, ::2]), ValueError, "logits"),
    (dict(temperature=torch.ones(3)), ValueError, "temperature"),
    (dict(floor=torch.ones(2, dtype=torch.float64)), TypeError, "floor"),
    (dict(greedy=torch.zeros(2)), TypeError, "greedy"),
    (dict(seed_keys=torch.zeros(2, 3, dtype=torch.int64)), ValueError, "seed_keys"),
    (dict(step_seed=True), TypeError, "step_seed"),
    (dict(num_splits=0), ValueError, "num_splits"),
    (dict(num_splits=129), ValueError, "num_splits"),
    (dict(counts=torch.zeros(2)), TypeError, "counts"),
    (dict(counts=torch.zeros(1, dtype=torch.int32)), ValueError, "counts"),
])
def test_kernel_launcher_rejects_bad_arguments(change, error, field):
    args = dict(logits=torch.zeros(2, 5), temperature=torch.ones(2), floor=None,
                greedy=torch.zeros(2, dtype=torch.bool), seeded=torch.zeros(2, dtype=torch.bool),
                seed_keys=torch.zeros(2, 2, dtype=torch.int64), step_seed=1)
    with pytest.raises(error, match=field):
        gumbel_sample(**{**args, **change})


# ----------------------------------------------------------------------------- no host sync

def test_sampling_path_never_reads_the_device(monkeypatch):
    """No .item()/.tolist()/nonzero()/bool()/int()/float() on any path (the engine is asynchronous).

    (On CUDA, ``torch.cuda.set_sync_debug_mode("error")`` checks the same end to end;
    benchmarks/sampler.py runs under it.)
    """
    logits = make_logits(0, 6, 40, 2.0, ties=False)
    batches = [
        [SamplingParams(temperature=0.0)] * 6,                                     # all greedy
        [SamplingParams(temperature=0.8, seed=i if i % 2 else None) for i in range(6)],
        [SamplingParams(min_p=0.2), SamplingParams(temperature=0)] * 3,            # min-p only
        [SamplingParams(top_k=5, top_p=0.8, seed=1), SamplingParams(top_p=0.5)] * 3,  # full sort
        [SamplingParams(top_k=5, top_p=0.8, min_p=0.1)] * 6,                       # candidates
    ]
    tensors = [SamplingTensors.build(b, list(range(6)), 40, "cpu") for b in batches]

    def forbidden(*_args, **_kwargs):
        raise AssertionError("the sampler read a device value on the host")
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "nonzero", forbidden)
    sampler = Sampler(OPS["torch"], torch.Generator().manual_seed(0))
    for t in tensors:
        sampler(logits, t)
