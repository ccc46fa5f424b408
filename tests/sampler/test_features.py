"""Penalties, logprobs and prompt logprobs: against plain per-row references, and through the executor.

The penalty reference counts tokens with ``collections.Counter`` row by row; logprobs
are checked against ``torch.log_softmax`` of the same logits; prompt logprobs against
Hugging Face's logits for every position of the whole prompt, over a prompt computed
in two chunks. Each penalty is tested on both sides of its edge (0 / 1 changes
nothing; a strong one moves the argmax as defined).
"""

from __future__ import annotations

import collections
import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the first triton import (conftest sets it too)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from minivllm.engine.plan import StepPlan  # noqa: E402
from minivllm.executor.device_batch import DeviceBatch, referenced_tokens  # noqa: E402
from minivllm.ops.dispatch import Ops  # noqa: E402
from minivllm.sampler import logprobs as logprobs_mod  # noqa: E402
from minivllm.sampler.logprobs import LogprobLayout, compute_logprobs, sliced_logprobs  # noqa: E402
from minivllm.sampler.penalties import PenaltyInputs, PenaltyTensors, apply_penalties  # noqa: E402
from minivllm.sampler.sampler import Sampler, SamplingTensors  # noqa: E402
from minivllm.sampling import SamplingParams  # noqa: E402
from minivllm.step_types import TokenHistory  # noqa: E402
from minivllm.testing import TinyConfig, hf_logits, make_hf_model, make_model_executor, save_hf_model  # noqa: E402

# The two implementations of every sampling op: the torch references and the Triton kernels
# (under the interpreter on the CPU).
OPS = {"torch": Ops.build("torch", torch.device("cpu"), torch.float32),
       "kernel": Ops.build("triton", torch.device("cpu"), torch.float32)}


V = 40
BS = 4


# ----------------------------------------------------------------------------- references

def reference_penalties(row: torch.Tensor, prompt: list[int], completion: list[int],
                        p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties on one row of logits, token by token (float32)."""
    out = row.float().clone()
    counts = collections.Counter(completion)
    r = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    for tok in set(prompt) | set(counts):
        out[tok] = out[tok] / r if out[tok] > 0 else out[tok] * r
    for tok, c in counts.items():
        out[tok] -= torch.tensor(p.frequency_penalty, dtype=torch.float32) * c
        out[tok] -= torch.tensor(p.presence_penalty, dtype=torch.float32)
    return out


def penalise(logits: torch.Tensor, rows: list[int], histories: list[TokenHistory],
             params: list[SamplingParams], referenced: torch.Tensor | None = None) -> torch.Tensor:
    return apply_penalties(logits, penalty_tensors(rows, histories, params, referenced))


def penalty_tensors(rows: list[int], histories: list[TokenHistory], params: list[SamplingParams],
                    referenced: torch.Tensor | None = None, vocab: int = V) -> PenaltyTensors:
    host = PenaltyInputs.gather(rows, histories, params, vocab)
    return host.on_device([torch.from_numpy(a) for a in host.arrays()], referenced)


def history(prompt: list[int], completion: list[int]) -> TokenHistory:
    return TokenHistory(np.array(prompt + completion, dtype=np.int64), len(prompt))


def make_logits(seed: int, rows: int, vocab: int = V) -> torch.Tensor:
    return torch.tensor(np.random.default_rng(seed).standard_normal((rows, vocab)) * 2, dtype=torch.float32)


# ----------------------------------------------------------------------------- penalties

MIXED = [  # (params, prompt, completion, referenced token or -1)
    (SamplingParams(temperature=0.0, presence_penalty=1.5), [1, 2, 2], [3, 3, 4], -1),
    (SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.7), [5], [6, 6, 6, 7], 6),
    (SamplingParams(temperature=0.0), [], [], -1),                                   # no penalties
    (SamplingParams(temperature=0.0, repetition_penalty=1.8), [8, 9, 9], [10], 11),
    (SamplingParams(temperature=1.2, seed=9, presence_penalty=-0.5, frequency_penalty=0.3,
                    repetition_penalty=0.6), [12, 13], [13, 14, 14], 12),
    (SamplingParams(temperature=0.7, seed=4), [], [], -1),                           # no penalties
]


def mixed_batch() -> tuple[torch.Tensor, list[int], list[TokenHistory], list[SamplingParams], torch.Tensor]:
    logits = make_logits(0, len(MIXED))
    rows = [i for i, (p, *_rest) in enumerate(MIXED) if p.has_penalties]
    histories = [history(MIXED[i][1], MIXED[i][2]) for i in rows]
    referenced = torch.tensor([m[3] for m in MIXED], dtype=torch.int64)
    return logits, rows, histories, [MIXED[i][0] for i in rows], referenced


def test_penalties_match_a_per_row_reference_and_leave_other_rows_alone():
    logits, rows, histories, params, referenced = mixed_batch()
    raw = logits.clone()
    got = penalise(logits, rows, histories, params, referenced)
    assert torch.equal(logits, raw)  # the raw logits stay raw (logprobs read them)
    for i, (p, prompt, completion, ref) in enumerate(MIXED):
        want = reference_penalties(raw[i], prompt, completion + ([ref] if ref >= 0 else []), p)
        if p.has_penalties:
            torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
            assert not torch.equal(got[i], raw[i])
        else:
            assert torch.equal(got[i], raw[i])


def test_sampler_applies_penalties_to_greedy_and_random_rows():
    logits, rows, histories, params, referenced = mixed_batch()
    all_params = [m[0] for m in MIXED]
    t = SamplingTensors.build(all_params, list(range(len(MIXED))), V, "cpu")
    pen = penalty_tensors(rows, histories, params, referenced)
    want_logits = penalise(logits, rows, histories, params, referenced)
    got = Sampler(OPS["torch"])(logits, t, step_seed=5, penalties=pen)
    assert torch.equal(got, Sampler(OPS["torch"])(want_logits, t, step_seed=5))
    greedy = [i for i, p in enumerate(all_params) if p.greedy]
    assert torch.equal(got[greedy], want_logits[greedy].argmax(dim=-1))


@pytest.mark.parametrize("neutral", [
    SamplingParams(presence_penalty=0.0), SamplingParams(frequency_penalty=0.0),
    SamplingParams(repetition_penalty=1.0),
])
def test_neutral_penalty_values_change_nothing(neutral):
    logits = make_logits(1, 2)
    h = history([1, 2, 3, 3], [3, 4, 4, 5])
    got = penalise(logits, [0, 1], [h, h], [neutral, neutral], torch.tensor([4, -1]))
    assert torch.equal(got, logits)


def test_presence_penalty_moves_the_argmax_off_completion_tokens():
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8], logits[0, 9] = 3.0, 2.0, 1.5   # 7 best, then 8, then 9
    greedy = SamplingParams(temperature=0.0, presence_penalty=2.0)
    # 7 in the prompt only: presence does not count the prompt.
    assert penalise(logits, [0], [history([7], [])], [greedy]).argmax() == 7
    # 7 in the completion: 3 - 2 = 1 < 2, so 8 wins; 8 fed by reference counts too: 9 wins.
    assert penalise(logits, [0], [history([], [7])], [greedy]).argmax() == 8
    assert penalise(logits, [0], [history([], [7])], [greedy], torch.tensor([8])).argmax() == 9
    # A negative presence penalty rewards repeats.
    boost = SamplingParams(temperature=0.0, presence_penalty=-2.0)
    assert penalise(logits, [0], [history([], [9])], [boost]).argmax() == 9


def test_frequency_penalty_scales_with_the_count():
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8] = 3.0, 2.0
    p = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    assert penalise(logits, [0], [history([], [7])], [p]).argmax() == 7          # 3 - 0.6 > 2
    assert penalise(logits, [0], [history([], [7, 7])], [p]).argmax() == 8       # 3 - 1.2 < 2
    assert penalise(logits, [0], [history([7, 7, 7], [])], [p]).argmax() == 7    # prompt not counted


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.full((1, V), -5.0)
    logits[0, 7], logits[0, 8], logits[0, 9], logits[0, 10] = 4.0, 3.0, -1.0, -2.0
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    got = penalise(logits, [0], [history([7], [9])], [p])[0]   # prompt counts for repetition
    assert got[7] == 2.0 and got[8] == 3.0 and got[9] == -2.0 and got[10] == -2.0
    assert got.argmax() == 8
    below_one = penalise(logits, [0], [history([8], [])], [SamplingParams(repetition_penalty=0.5)])[0]
    assert below_one[8] == 6.0 and below_one.argmax() == 8


def test_penalty_inputs_reject_out_of_vocab_tokens():
    with pytest.raises(ValueError, match="outside"):
        PenaltyInputs.gather([0], [history([V], [])], [SamplingParams(presence_penalty=1.0)], V)


# ----------------------------------------------------------------------------- logprobs

def test_logprobs_match_log_softmax_with_ordered_top_k():
    logits = make_logits(2, 5).to(torch.bfloat16)
    targets = torch.tensor([0, 3, 39, 7, 7])
    lp = compute_logprobs(logits, targets, k=6)
    want = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(lp.token_logprobs, want.gather(1, targets[:, None])[:, 0])
    assert lp.token_logprobs.dtype == torch.float32 and lp.top_ids.shape == (5, 6)
    assert torch.equal(lp.top_logprobs, want.gather(1, lp.top_ids))
    assert (lp.top_logprobs[:, :-1] >= lp.top_logprobs[:, 1:]).all()  # most likely first
    assert torch.equal(lp.top_logprobs[:, 0], want.max(dim=-1).values)
    none = compute_logprobs(logits, targets, k=0)
    assert none.top_ids.shape == (5, 0) and torch.equal(none.token_logprobs, lp.token_logprobs)


def test_sliced_logprobs_equal_one_pass():
    logits = make_logits(3, 10)
    targets = torch.arange(10) * 3
    whole = compute_logprobs(logits, targets, 4)
    sliced = sliced_logprobs(lambda s: logits[s], targets, 4, rows_per_slice=3)
    for a, b in zip((whole.token_logprobs, whole.top_ids, whole.top_logprobs),
                    (sliced.token_logprobs, sliced.top_ids, sliced.top_logprobs)):
        assert torch.equal(a, b)


def test_packed_logprobs_unpack_per_sequence_with_its_own_k():
    logits = make_logits(4, 6)
    targets = torch.tensor([1, 2, 3, 4, 5, 6])
    lp = compute_logprobs(logits, targets, k=5)
    layout = LogprobLayout(seq_ids=(7, 3, 9), num_rows=(1, 3, 2), ks=(5, 0, 2))
    assert layout.size == lp.packed().shape[0]
    out = layout.unpack(lp.packed().numpy())
    want = torch.log_softmax(logits, dim=-1)
    for sid, lo, hi, k in ((7, 0, 1, 5), (3, 1, 4, 0), (9, 4, 6, 2)):
        got = out[sid]
        assert got.token_logprobs.dtype == np.float32 and got.top_ids.dtype == np.int64
        assert got.top_ids.shape == (hi - lo, k) and got.top_logprobs.shape == (hi - lo, k)
        np.testing.assert_array_equal(got.token_logprobs, want[lo:hi].gather(1, targets[lo:hi, None])[:, 0])
        np.testing.assert_array_equal(got.top_ids, lp.top_ids[lo:hi, :k])
        np.testing.assert_array_equal(got.top_logprobs, lp.top_logprobs[lo:hi, :k])


# ----------------------------------------------------------------------------- no host sync

def test_penalties_and_logprobs_never_read_the_device(monkeypatch):
    logits, rows, histories, params, referenced = mixed_batch()
    t = SamplingTensors.build([m[0] for m in MIXED], list(range(len(MIXED))), V, "cpu")
    host = PenaltyInputs.gather(rows, histories, params, V)
    uploaded = [torch.from_numpy(a) for a in host.arrays()]
    prev_rows = torch.tensor([-1, 0, -1, 2])
    batch = DeviceBatch(input_ids=torch.zeros(4, dtype=torch.int64), prev_rows=prev_rows,
                        positions=torch.zeros(4, dtype=torch.int64), sample_indices=torch.tensor([1, 3]),
                        attn_metadata=None, num_seqs=2, table_width=1)  # type: ignore[arg-type]

    def forbidden(*_args, **_kwargs):
        raise AssertionError("a device value was read on the host")
    for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    monkeypatch.setattr(torch, "nonzero", forbidden)
    assert referenced_tokens(batch, torch.tensor([5, 6, 7])).shape == (2,)
    tokens = Sampler(OPS["torch"])(logits, t, penalties=host.on_device(uploaded, referenced))
    sliced_logprobs(lambda s: logits[s], tokens, 5, rows_per_slice=4).packed()


def test_referenced_tokens_resolve_only_the_tokens_fed_by_reference():
    # Three sampling rows: the first fed by reference (prev row 2), the others given.
    batch = DeviceBatch(input_ids=torch.tensor([4, -1, 8, 9]), prev_rows=torch.tensor([-1, 2, -1, -1]),
                        positions=torch.zeros(4, dtype=torch.int64), sample_indices=torch.tensor([1, 2, 3]),
                        attn_metadata=None, num_seqs=3, table_width=1)  # type: ignore[arg-type]
    assert referenced_tokens(batch, torch.tensor([10, 11, 12])).tolist() == [12, -1, -1]


# ----------------------------------------------------------------------------- through the executor

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    hf = make_hf_model(TinyConfig(), seed=3)
    return hf, save_hf_model(hf, tmp_path_factory.mktemp("features"))


def make_executor(path: str):
    return make_model_executor(path, device="cpu", dtype="float32", kernels="torch",
                               block_size=BS, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64)


def plan_of(seqs: list[dict]) -> StepPlan:
    """A plan from per-sequence dicts: tokens, start, table, sample, params (+ optional extras)."""
    return StepPlan.build(
        seq_ids=[s.get("id", i) for i, s in enumerate(seqs)], token_chunks=[s["tokens"] for s in seqs],
        start_positions=[s["start"] for s in seqs], block_tables=[s["table"] for s in seqs],
        sample=[s["sample"] for s in seqs], sampling_params=[s["params"] for s in seqs], block_size=BS,
        feeds_prev_sample=[s.get("ref", False) for s in seqs],
        histories=[s.get("history") for s in seqs],
        prompt_logprob_targets=[s.get("targets") for s in seqs])


def test_executor_prompt_logprobs_over_two_chunks_match_hf(model, monkeypatch):
    hf, path = model
    monkeypatch.setattr(logprobs_mod, "SLICE_ROWS", 3)  # several slices, across sequences
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 97, size=12).tolist()
    other = rng.integers(0, 97, size=3).tolist()
    ask = SamplingParams(temperature=0.0, prompt_logprobs=4, logprobs=2)
    ex = make_executor(path)
    head_rows: list[int] = []
    head = ex.model.compute_logits
    monkeypatch.setattr(ex.model, "compute_logits", lambda h: head_rows.append(h.shape[0]) or head(h))
    # Chunk 1: positions 0..6 predict prompt[1..7]; nothing samples.
    first = ex.execute(plan_of([dict(tokens=prompt[:7], start=0, table=(5, 1, 9), sample=False, params=ask,
                                     targets=np.array(prompt[1:8]))]))
    assert first.sampled == {} and first.logprobs == {} and set(first.prompt_logprobs) == {0}
    # Chunk 2: positions 7..11 feed, only 7..10 have a next prompt token (P = 4 < query_len 5);
    # batched after a whole 3-token prompt with its own K (P = 2) that asks for logprobs too.
    small = SamplingParams(temperature=0.0, prompt_logprobs=1, logprobs=0)
    second = ex.execute(plan_of([
        dict(id=1, tokens=other, start=0, table=(3,), sample=True, params=small, targets=np.array(other[1:])),
        dict(id=0, tokens=prompt[7:], start=7, table=(5, 1, 9), sample=True, params=ask,
             targets=np.array(prompt[8:])),
    ]))
    want_other = torch.log_softmax(hf_logits(hf, other), dim=-1)
    got_other = second.prompt_logprobs[1]
    assert got_other.top_ids.shape == (2, 1)
    np.testing.assert_allclose(got_other.token_logprobs, want_other[[0, 1], other[1:]].numpy(), atol=1e-4)
    np.testing.assert_allclose(got_other.top_logprobs[:, 0], want_other[:2].max(dim=-1).values.numpy(),
                               atol=1e-4)
    want = torch.log_softmax(hf_logits(hf, prompt), dim=-1)  # (12, V)
    got = [first.prompt_logprobs[0], second.prompt_logprobs[0]]
    assert [g.token_logprobs.shape for g in got] == [(7,), (4,)]
    token_lp = np.concatenate([g.token_logprobs for g in got])
    np.testing.assert_allclose(token_lp, want[np.arange(11), prompt[1:]].numpy(), atol=1e-4)
    top = torch.from_numpy(np.concatenate([g.top_logprobs for g in got]))
    ids = torch.from_numpy(np.concatenate([g.top_ids for g in got]))
    assert ids.shape == (11, 4) and ids.dtype == torch.int64
    torch.testing.assert_close(top, want[:11].topk(4, dim=-1).values, atol=1e-4, rtol=0)
    torch.testing.assert_close(want[:11].gather(1, ids), top, atol=1e-4, rtol=0)
    assert set(second.prompt_logprobs) == {0, 1} and set(second.logprobs) == {0, 1}
    # The LM head saw the prompt rows 3 at a time (7 = 3 + 3 + 1, then 2 + 4 = 3 + 3 across
    # sequences) and the 2 sampling rows: never a (P, V) block.
    assert sorted(head_rows) == [1, 2, 3, 3, 3, 3]
    # The sampled token's logprob is the last position's.
    assert second.sampled[0] == int(want[11].argmax())
    np.testing.assert_allclose(second.logprobs[0].token_logprobs, [want[11].max().item()], atol=1e-4)
    assert second.logprobs[1].top_ids.shape == (1, 0)


def test_executor_logprobs_are_raw_and_only_for_rows_that_ask(model):
    _hf, path = model
    rows = [
        SamplingParams(temperature=0.0, logprobs=3, presence_penalty=2.0, repetition_penalty=3.0),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.9, seed=2, logprobs=5),
    ]
    seqs = [dict(tokens=[3, 1, 4], start=0, table=(0,), sample=True, params=rows[0],
                 history=history([3, 1, 4], [])),
            dict(tokens=[1, 5], start=0, table=(1,), sample=True, params=rows[1]),
            dict(tokens=[9, 2, 6, 5], start=0, table=(2,), sample=True, params=rows[2])]
    ex = make_executor(path)
    want = torch.log_softmax(ex.compute_logits(plan_of(seqs)), dim=-1)  # raw: before penalties
    result = ex.execute(plan_of(seqs))
    assert set(result.logprobs) == {0, 2}
    for sid, k in ((0, 3), (2, 5)):
        got = result.logprobs[sid]
        tok = result.sampled[sid]
        np.testing.assert_allclose(got.token_logprobs, [want[sid, tok].item()], atol=1e-6)
        np.testing.assert_allclose(got.top_logprobs[0], want[sid].topk(k).values.numpy(), atol=1e-6)
        assert got.top_ids.shape == (1, k)


def test_executor_greedy_decoding_with_penalties_follows_the_reference(model):
    """Decode steps feed the previous sample by reference (not in the history), as the async
    engine does; each token must be the argmax of the reference-penalised raw logits."""
    _hf, path = model
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0,
                            repetition_penalty=1.5)
    prompt = [11, 12, 13, 11]
    table = (4, 7, 2, 8)

    def decode(p: SamplingParams, steps: int = 10) -> list[int]:
        ex, ref_ex = make_executor(path), make_executor(path)
        out: list[int] = []
        for step in range(steps):
            # From step 1 on, the last token is fed by reference: the host does not know it yet,
            # so the history (the known tokens) lacks it.
            fed = prompt if step == 0 else [-1]
            seq = dict(tokens=fed, start=0 if step == 0 else len(prompt) + len(out) - 1, table=table,
                       sample=True, params=p, ref=step > 0,
                       history=history(prompt, out[:-1]) if p.has_penalties else None)
            tok = ex.execute(plan_of([seq])).sampled[0]
            # The reference: the same step with every token given, its raw logits penalised by hand,
            # the token fed this step included in the completion.
            plain = dict(seq, tokens=prompt if step == 0 else [out[-1]], ref=False, history=None,
                         params=SamplingParams(temperature=0.0))
            logits = ref_ex.compute_logits(plan_of([plain]))[0]
            assert tok == int(reference_penalties(logits, prompt, out, p).argmax())
            out.append(tok)
        return out

    penalised, plain = decode(params), decode(SamplingParams(temperature=0.0))
    assert len(set(plain)) < len(plain)          # without penalties this model repeats itself...
    assert penalised != plain


def test_executor_rejects_histories_and_targets_that_do_not_match(model):
    _hf, path = model
    ex = make_executor(path)
    pen = SamplingParams(temperature=0.0, presence_penalty=1.0)
    base = dict(tokens=[1, 2, 3], start=0, table=(0,), sample=True)
    missing = plan_of([dict(base, params=pen),
                       dict(base, table=(1,), params=pen, history=history([1, 2, 3], []))])
    with pytest.raises(ValueError, match="histories"):
        ex.execute(missing)
    extra = plan_of([dict(base, params=SamplingParams(), history=history([1, 2, 3], []))])
    with pytest.raises(ValueError, match="histories"):
        ex.execute(extra)
    unasked = plan_of([dict(base, params=SamplingParams(), targets=np.array([2, 3]))])
    with pytest.raises(ValueError, match="prompt-logprob targets"):
        ex.execute(unasked)
    too_long = plan_of([dict(base, params=SamplingParams(prompt_logprobs=1), targets=np.array([2, 3, 4, 5]))])
    with pytest.raises(ValueError, match="prompt-logprob targets"):
        ex.execute(too_long)


def test_warm_up_runs_every_sampler_feature(model):
    """The CUDA start-up pass (penalties, logprobs, a prompt-logprob slice) runs off CUDA too."""
    _hf, path = model
    make_executor(path)._warm_up()


def test_engine_async_equals_sync_with_every_feature(model):
    """Through ``LLM``: one step in flight (the last token fed by reference, absent from the
    history) gives the synchronous engine's tokens and logprobs; prompts are chunked."""
    from minivllm import LLM

    hf, path = model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, int(n)).tolist() for n in (20, 7, 13)]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=0.5, logprobs=3, prompt_logprobs=2),
        SamplingParams(temperature=1.0, seed=4, max_tokens=8, ignore_eos=True, repetition_penalty=1.7,
                       logprobs=0),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    outs = []
    with LLM(path, device="cpu", kernels="torch", skip_tokenizer_init=True, block_size=BS,
             num_blocks=32, max_num_seqs=4, max_num_batched_tokens=16) as llm:
        for async_scheduling in (False, True):
            llm.engine.set_async_scheduling(async_scheduling)
            outs.append(llm.generate(prompts, params, use_tqdm=False))
    sync, async_ = outs
    assert [o.token_ids for o in sync] == [o.token_ids for o in async_]
    for s, a in zip(sync, async_):
        assert (s.logprobs is None) == (a.logprobs is None)
        for x, y in zip(s.logprobs or (), a.logprobs or ()):
            assert x.keys() == y.keys()
            np.testing.assert_allclose(list(x.values()), list(y.values()), atol=1e-5)
    # The 20-token prompt went through two chunks of at most 16 tokens.
    want = torch.log_softmax(hf_logits(hf, prompts[0]), dim=-1)
    got = sync[0].prompt_logprobs
    assert got[0] is None and len(got) == 20
    for i in range(1, 20):
        assert prompts[0][i] in got[i] and len(got[i]) <= 3
        for tok, lp in got[i].items():
            assert abs(lp - want[i - 1, tok].item()) < 1e-4


def test_a_top_p_below_float32_keeps_the_most_likely_token() -> None:
    # 1e-300 rounds to 0 in float32; it once kept no token and crashed the sampler.
    sampler = Sampler(OPS["torch"], torch.Generator().manual_seed(0))
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    for top_p in (1e-300, 1e-40):
        params = [SamplingParams(top_p=top_p), SamplingParams(top_p=top_p, top_k=5),
                  SamplingParams(top_p=top_p, seed=3)]
        tensors = SamplingTensors.build(params, np.array([3, 3, 3]), 50, torch.device("cpu"))
        assert sampler(logits, tensors).tolist() == logits.argmax(-1).tolist()


def test_n_and_top_k_are_bounded() -> None:
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=129)
    with pytest.raises(ValueError, match="top_k must be"):
        SamplingParams(top_k=2**31)
    assert SamplingParams(n=128, top_k=2**31 - 1).n == 128


def test_logit_bias_shapes_the_sampling_and_not_the_logprobs(model):
    """A bias of 100 all but forces its token and -100 bans the argmax, for greedy and random
    rows (added before either sampler runs); logprobs stay those of the raw logits."""
    from minivllm.sampler.sampler import apply_logit_bias
    logits = torch.randn(3, 40)
    params = [SamplingParams(logit_bias={7: 100}), SamplingParams(), SamplingParams(logit_bias={3: -100, 5: 2.5})]
    assert params[2].logit_bias == ((3, -100.0), (5, 2.5))
    out = apply_logit_bias(logits, params)
    want = logits.clone()
    want[0, 7] += 100
    want[2, 3] -= 100
    want[2, 5] += 2.5
    torch.testing.assert_close(out, want)
    assert apply_logit_bias(logits, [SamplingParams()] * 3) is logits
    _hf, path = model
    ex = make_executor(path)
    seqs = [dict(tokens=[3, 1, 4], start=0, table=(0,), sample=True),
            dict(tokens=[1, 5], start=0, table=(1,), sample=True)]
    raw = ex.compute_logits(plan_of([s | {"params": SamplingParams()} for s in seqs]))
    best = int(raw[1].argmax())
    for temperature in (0.0, 1.0):
        rows = [SamplingParams(temperature=temperature, seed=4, logit_bias={11: 100}, logprobs=1),
                SamplingParams(temperature=0.0, logit_bias={best: -100})]
        result = ex.execute(plan_of([s | {"params": p} for s, p in zip(seqs, rows)]))
        assert result.sampled[0] == 11 and result.sampled[1] != best
        raw_lp = torch.log_softmax(raw[0], dim=-1)[11].item()
        np.testing.assert_allclose(result.logprobs[0].token_logprobs, [raw_lp], atol=1e-6)


@pytest.mark.parametrize("bias, words", [({-1: 1}, "token ids >= 0"), ({1: 101}, "[-100, 100]"),
                                         ({1: "x"}, "numbers"), (5, "must map")])
def test_bad_logit_bias_is_refused(bias, words):
    with pytest.raises(ValueError, match="logit_bias") as e:
        SamplingParams(logit_bias=bias)
    assert words in str(e.value)


def test_allowed_token_ids_keep_the_sampling_to_them(model):
    from minivllm.sampler.sampler import apply_logit_bias
    logits = torch.randn(2, 30)
    out = apply_logit_bias(logits, [SamplingParams(allowed_token_ids=[4, 2, 4]), SamplingParams()])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [2, 4]
    torch.testing.assert_close(out[0, [2, 4]], logits[0, [2, 4]])
    torch.testing.assert_close(out[1], logits[1])
    _hf, path = model
    ex = make_executor(path)
    seq = dict(tokens=[3, 1, 4], start=0, table=(0,), sample=True)
    for seed in range(4):
        p = SamplingParams(temperature=1.5, seed=seed, allowed_token_ids=[6, 13], logit_bias={13: -1})
        assert ex.execute(plan_of([seq | {"params": p}])).sampled[0] in (6, 13)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_min_tokens_and_bad_words_through_the_engine(model):
    """Through ``LLM`` on the tiny model, greedy, both scheduling modes: a stop token the
    completion would write second does not end it before ``min_tokens``, and the token after a
    bad word's prefix is the best other one (HF's logits with it excluded)."""
    from minivllm import LLM

    hf, path = model
    prompt = [3, 1, 4, 1, 5]
    with LLM(path, device="cpu", kernels="torch", skip_tokenizer_init=True, block_size=BS,
             num_blocks=32, max_num_seqs=4) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
        g = tuple(free)
        stop_second = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[g[1]])
        word = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words_token_ids=[g[1:3]])
        for async_scheduling in (False, True):
            llm.engine.set_async_scheduling(async_scheduling)
            stopped, held, banned = llm.generate(
                [prompt] * 3, [stop_second, dataclasses.replace(stop_second, min_tokens=3), word], use_tqdm=False)
            assert stopped.token_ids == g[:2] and stopped.finish_reason == "stop"
            assert held.token_ids[0] == g[0] and held.token_ids[1] != g[1] and len(held.token_ids) >= 3
            assert banned.token_ids[:2] == g[:2] and banned.token_ids[2] != g[2]
            for out, at in ((banned, 2), (held, 1)):  # the banned token's runner-up
                logits = hf_logits(hf, prompt + list(g[:at]))[-1]
                logits[g[at]] = float("-inf")
                assert out.token_ids[at] == int(logits.argmax())
