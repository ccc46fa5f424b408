"""Qwen3.5 hybrid models (dense and MoE) end to end through ``LLM`` on the CPU, float32, against
transformers' greedy ``generate``: both scheduling modes, prefix-cache hits resuming from state
snapshots saved inside chunks, chunked prefill under preemption, n > 1, speculation (rejected
drafts must leave the state; n-gram drafting end to end); the save points of the reference
ops; and the refusals of plans whose state fields do not fit the model.

Which planted bug each test catches (each was planted and seen to fail):
- a skipped snapshot restore, or a save one token off: ``test_prefix_hit_resumes_from_a_snapshot``,
  ``test_n_completions`` and the preemption test (a conv save off by one also fails the conv's
  save-point test, which names the offset);
- a slot not reset at a sequence's first chunk (has_initial_state always True):
  ``test_greedy_matches_transformers`` (slots are taken again by later prompts) and the
  preemption test;
- rejected drafts kept in the state: ``test_speculation_keeps_only_accepted_drafts_in_the_state``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.engine.plan import StepPlan
from minivllm.engine.state_cache import STATE_CONTINUE, STATE_RESET
from minivllm.executor.linear_state import StateInputs, StateLayout, check_no_state_fields
from minivllm.kernels.linear_attention_reference import (
    SavePoints, causal_conv1d_reference, gated_delta_rule_chunked_reference, gated_delta_rule_recurrent_reference,
    save_points)
from minivllm.testing import hf_generate, make_plan
from tests.model.test_qwen3_5 import saved_model

pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")

BS = 4                 # block size: a 40-token prompt crosses ten block boundaries
NEW = 8                # greedy tokens per completion
LENGTHS = (5, 17, 40, 23)
PREFIX = 26            # shared prefix of the prefix-cache prompts: 6 full blocks and 2 tokens
TAILS = (3, 9, 14)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _prompts(vocab: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, vocab, PREFIX).tolist()
    # Every token once, then a few again: n-gram lookup finds any last token in it, so it drafts
    # at every step.
    every = rng.permutation(vocab).tolist()
    return {
        "plain": [rng.integers(0, vocab, n).tolist() for n in LENGTHS],
        "cold": [prefix + rng.integers(0, vocab, n).tolist() for n in TAILS],
        "warm": [prefix + rng.integers(0, vocab, n).tolist() for n in TAILS],
        "every_token": [every + every[:3]],
    }


def _setup(name: str, tmp_path_factory) -> tuple[str, str, dict, dict]:
    """(name, checkpoint path, prompts by kind, transformers' greedy tokens by kind)."""
    hf, path = saved_model(name, tmp_path_factory)
    prompts = _prompts(hf.config.vocab_size)
    refs = {kind: [hf_generate(hf, p, NEW) for p in ps] for kind, ps in prompts.items()}
    return name, path, prompts, refs


@pytest.fixture(scope="module", params=["dense-lin-first", "moe-shared-full-first"])
def setup(request, tmp_path_factory):
    return _setup(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """``setup`` of the dense model only (the Triton test: the kernels are the MoE model's too,
    and the interpreter is slow)."""
    return _setup("dense-lin-first", tmp_path_factory)


def make_llm(path: str, **options: object) -> LLM:
    settings: dict[str, object] = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, block_size=BS,
                                       max_num_seqs=4, max_model_len=64, num_blocks=96)
    return LLM(path, **{**settings, **options})  # type: ignore[arg-type]


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_matches_transformers(setup, async_scheduling: bool) -> None:
    """Prompts of 5 to 40 tokens, two at a time (slots are taken again by later prompts, whose
    first chunk must ignore what the slot holds), no prefix caching (so no snapshot entries):
    transformers' tokens."""
    _, path, prompts, refs = setup
    llm = make_llm(path, max_num_seqs=2, enable_prefix_caching=False)
    llm.engine.set_async_scheduling(async_scheduling)
    assert llm.engine.executor.state_pool() == (2, 0)
    assert tokens(llm, prompts["plain"]) == refs["plain"]


def test_prefix_hit_resumes_from_a_snapshot(setup) -> None:
    """Prompts sharing a 26-token prefix, snapshots every 2nd block (saved inside the prompts'
    one-chunk prefills): cold, then new tails on the cached prefix (a hit resumes from the
    snapshot at block 6), then the cold prompts again (a hit at each prompt's last full block):
    transformers' tokens every time, and the hits are whole blocks at snapshot boundaries."""
    _, path, prompts, refs = setup
    llm = make_llm(path, state_snapshot_interval=2)
    assert tokens(llm, prompts["cold"]) == refs["cold"]
    warm = llm.generate(prompts["warm"], GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in warm] == refs["warm"]
    assert [o.num_cached_tokens for o in warm] == [24] * len(TAILS)
    again = llm.generate(prompts["cold"], GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in again] == refs["cold"]
    assert [o.num_cached_tokens for o in again] == [resumes_at(PREFIX + n, interval=2) for n in TAILS]


def resumes_at(prompt_len: int, interval: int) -> int:
    """Where a whole-prompt hit resumes: the deepest block boundary short of the prompt's last
    token that has a snapshot (every ``interval``-th, and the prompt's last full block)."""
    hit = (prompt_len - 1) // BS
    snapshots = [j for j in range(1, hit + 1) if j % interval == 0 or j == prompt_len // BS]
    return max(snapshots, default=0) * BS


def test_chunked_prefill_under_preemption(setup) -> None:
    """A 7-token budget (chunks not aligned to blocks, snapshots saved mid-chunk) and a pool of
    14 blocks for four sequences that need up to 12 each: sequences are preempted and resume
    from their cache hits (restores), and every token is still transformers'."""
    _, path, prompts, refs = setup
    llm = make_llm(path, max_num_batched_tokens=7, num_blocks=14, state_snapshot_interval=1)
    for async_scheduling in (False, True):
        llm.engine.set_async_scheduling(async_scheduling)
        before = llm.engine.stats.num_preemptions
        assert tokens(llm, prompts["plain"]) == refs["plain"]
        assert llm.engine.stats.num_preemptions > before


def test_triton_kernels_give_transformers_tokens(dense) -> None:
    """The same through the Triton kernels (the interpreter: the conv and the delta rule token
    by token, with save points): chunked prefill under preemption, and prefix hits resuming
    from snapshots saved mid-chunk."""
    _, path, prompts, refs = dense
    llm = make_llm(path, kernels="triton", max_num_batched_tokens=13, num_blocks=16, state_snapshot_interval=1)
    assert tokens(llm, prompts["plain"][1:3]) == refs["plain"][1:3]
    assert llm.engine.stats.num_preemptions > 0
    assert tokens(llm, prompts["cold"][:1]) == refs["cold"][:1]
    warm = llm.generate(prompts["warm"][:1], GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in warm] == refs["warm"][:1] and warm[0].num_cached_tokens == 24


def test_n_completions(setup) -> None:
    """n = 3 greedy: the other two completions read the prompt from the prefix cache and resume
    from the snapshot at its last full block; all three are transformers' tokens."""
    _, path, prompts, refs = setup
    llm = make_llm(path, state_snapshot_interval=4)
    outs = llm.generate(prompts["plain"][2:], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, n=3),
                        use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [ref for ref in refs["plain"][2:] for _ in range(3)]
    assert [o.num_cached_tokens for o in outs] == [hit for n in LENGTHS[2:] for hit in (0, *[resumes_at(n, 4)] * 2)]


class WrongEveryThird:
    """Drafts each prompt's known greedy continuation, the draft of every third continuation
    position off by one: a drafted step keeps some drafts and rejects the rest."""

    on_device = False

    def __init__(self, truth: dict[tuple[int, ...], list[int]], k: int, vocab_size: int) -> None:
        self.truth, self.num_speculative_tokens, self.vocab_size = truth, k, vocab_size

    def config(self) -> dict[str, object]:
        return {"method": "wrong-every-third", "num_speculative_tokens": self.num_speculative_tokens}

    def propose(self, contexts: list[list[int]], max_drafts: list[int], names: tuple[str, ...] = ()) -> list[list[int]]:
        out = []
        for context, k in zip(contexts, max_drafts):
            prompt = next(p for p in self.truth if tuple(context[:len(p)]) == p)
            done = len(context) - len(prompt)
            out.append([t if (done + i) % 3 != 2 else (t + 1) % self.vocab_size
                        for i, t in enumerate(self.truth[prompt][done:done + k])])
        return out


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_speculation_keeps_only_accepted_drafts_in_the_state(setup, async_scheduling: bool) -> None:
    """Drafts of which some are rejected, on four prompts at once: a drafted row's slot must end
    holding the state after its kept tokens only (its draft states are per batch row); the
    tokens are transformers'. Then n-gram drafting on a prompt holding every token: the same
    tokens as without speculation."""
    _, path, prompts, refs = setup
    llm = make_llm(path, speculative_config=SPEC)
    llm.engine.set_async_scheduling(async_scheduling)
    vocab = llm.model_config.vocab_size
    llm.engine.proposer = WrongEveryThird({tuple(p): r for p, r in zip(prompts["plain"], refs["plain"])}, 3, vocab)
    stats = llm.engine.stats
    assert tokens(llm, prompts["plain"]) == refs["plain"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    ngram = make_llm(path, speculative_config=SPEC, max_model_len=128)
    ngram.engine.set_async_scheduling(async_scheduling)
    assert tokens(ngram, prompts["every_token"]) == refs["every_token"]
    assert ngram.engine.stats.num_draft_tokens > 0


# ---- save points of the reference ops ---------------------------------------------------------

LENS = (9, 6)             # two sequences; the second's saves must use its own rows
SAVES = ((1, 2, 3, 5, 9), (2, 6))  # offsets per sequence: below K - 1 = 3, at it, inside, at the end
SLOT_OF = (4, 1)
CONTINUES = (True, False)  # the first continues from its slot, the second starts fresh


def _save_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, offsets, entries): save i of the step goes to entry 6 + i."""
    rows = [b for b, offsets in enumerate(SAVES) for _ in offsets]
    offsets = [o for offsets in SAVES for o in offsets]
    return torch.tensor(rows), torch.tensor(offsets), torch.arange(6, 6 + len(offsets))


def _first_tokens(b: int, o: int) -> tuple[int, int]:
    """Rows of sequence b's first o tokens in the step's concatenation."""
    start = sum(LENS[:b])
    return start, start + o


def test_conv_save_points_equal_a_shorter_feed() -> None:
    """A save after o tokens equals the final conv state of the same sequence fed only its first
    o tokens (from the same initial state: for o < K - 1 part of it is the initial state);
    outputs and final states are those without saves."""
    gen = torch.Generator().manual_seed(3)
    channels, width = 5, 4
    x, w = torch.randn(sum(LENS), channels, generator=gen), torch.randn(channels, width, generator=gen)
    state = torch.randn(6 + sum(map(len, SAVES)), channels, width - 1, generator=gen)
    cu, slots, init = torch.tensor([0, *np.cumsum(LENS)]), torch.tensor(SLOT_OF), torch.tensor(CONTINUES)
    plain_state, saved_state = state.clone(), state.clone()
    plain = causal_conv1d_reference(x, w, plain_state, cu, slots, init)
    saved = causal_conv1d_reference(x, w, saved_state, cu, slots, init, save_points(*_save_tensors()))
    assert torch.equal(saved, plain) and torch.equal(saved_state[:6], plain_state[:6])
    entry = 6
    for b, offsets in enumerate(SAVES):
        for o in offsets:
            short = state.clone()
            lo, hi = _first_tokens(b, o)
            causal_conv1d_reference(x[lo:hi], w, short, torch.tensor([0, o]), slots[b:b + 1], init[b:b + 1])
            assert torch.equal(saved_state[entry], short[SLOT_OF[b]]), (b, o)
            entry += 1


@pytest.mark.parametrize("rule", ["chunked", "recurrent"])
def test_delta_rule_save_points_equal_a_shorter_feed(rule: str) -> None:
    """A save after o tokens equals the final recurrent state of the same sequence fed only its
    first o tokens; the chunked form (chunks of 4: saves inside chunks and on their edges)
    splits a chunk at a save and still gives the outputs without saves."""
    gen = torch.Generator().manual_seed(4)
    hk, h, k_dim, v_dim, t = 2, 4, 8, 6, sum(LENS)
    q, k = torch.randn(t, hk, k_dim, generator=gen), torch.randn(t, hk, k_dim, generator=gen)
    v = torch.randn(t, h, v_dim, generator=gen)
    g, beta = -torch.rand(t, h, generator=gen) * 0.7, torch.rand(t, h, generator=gen)
    state = torch.randn(6 + sum(map(len, SAVES)), h, k_dim, v_dim, generator=gen)
    slots, init = torch.tensor(SLOT_OF), torch.tensor(CONTINUES)

    def run(lo: int, hi: int, lens: list[int], s: torch.Tensor, rows: slice,
            saves: SavePoints | None = None) -> torch.Tensor:
        """The rule over rows lo..hi, sequences ``rows`` of ``lens`` tokens."""
        args = (q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s, torch.tensor([0, *np.cumsum(lens)]),
                slots[rows], init[rows])
        if rule == "chunked":
            return gated_delta_rule_chunked_reference(*args, saves, chunk_size=4)
        return gated_delta_rule_recurrent_reference(*args, saves)

    plain_state, saved_state = state.clone(), state.clone()
    plain = run(0, t, list(LENS), plain_state, slice(0, 2))
    saved = run(0, t, list(LENS), saved_state, slice(0, 2), save_points(*_save_tensors()))
    torch.testing.assert_close(saved, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(saved_state[:6], plain_state[:6], atol=1e-5, rtol=1e-5)
    entry = 6
    for b, offsets in enumerate(SAVES):
        for o in offsets:
            short = state.clone()
            run(*_first_tokens(b, o), [o], short, slice(b, b + 1))
            torch.testing.assert_close(saved_state[entry], short[SLOT_OF[b]], atol=1e-5, rtol=1e-5, msg=f"{b} {o}")
            entry += 1


# ---- plans whose state fields do not fit the model --------------------------------------------

def _plan(**state: object) -> StepPlan:
    plan = make_plan([([1, 2, 3], 0, (0,), True), ([4, 5], 0, (1,), True)], BS)
    return StepPlan(**{**plan.__dict__, **state})


def test_state_fields_are_checked() -> None:
    """A hybrid plan without slots, a slot outside the pool or used twice, an unknown start, a
    save past a row's known tokens (a drafted row's drafts are not known), too many drafts; a
    plan with state fields for an attention-only model: each a ValueError naming the field."""
    layout = StateLayout(num_slots=4, num_snapshots=2, max_drafts=1)
    slots, init = np.array([0, 3], dtype=np.int32), np.array([STATE_RESET, 1], dtype=np.int32)
    bad = [(dict(), "state_slots"),
           (dict(state_slots=np.array([0, 4], dtype=np.int32), state_init=init), "state_slots"),
           (dict(state_slots=np.array([2, 2], dtype=np.int32), state_init=init), "state_slots"),
           (dict(state_slots=slots, state_init=np.array([STATE_CONTINUE, 2], dtype=np.int32)), "state_init"),
           (dict(state_slots=slots, state_init=init, state_saves=(((4, 0),), ())), "state_saves"),
           (dict(state_slots=slots, state_init=init, state_saves=(((3, 0),), ()),
                 num_drafts=np.array([1, 0], dtype=np.int32)), "state_saves"),
           (dict(state_slots=slots, state_init=init, num_drafts=np.array([0, 2], dtype=np.int32)), "num_drafts")]
    for fields, match in bad:
        with pytest.raises(ValueError, match=match):
            StateInputs.from_plan(_plan(**fields), layout)
    inputs = StateInputs.from_plan(_plan(state_slots=slots, state_init=init, state_saves=(((3, 1),), ()),
                                         num_drafts=np.array([0, 1], dtype=np.int32)), layout)
    assert inputs.has_initial_state.tolist() == [0, 1]
    assert (inputs.restore_from.tolist(), inputs.restore_to.tolist()) == ([4 + 1], [3])
    # The snapshot save, then the drafted row's state after its last token into its draft entry.
    assert inputs.save_rows.tolist() == [0, 1] and inputs.save_offsets.tolist() == [3, 1]
    assert inputs.save_slots.tolist() == [4 + 1, 6 + 1 * 1]
    assert inputs.save_bounds.tolist() == [0, 1, 2]  # row b's save points: bounds[b] .. bounds[b + 1] - 1
    for fields in (dict(state_slots=slots, state_init=init), dict(state_saves=(((1, 0),), ()))):
        with pytest.raises(ValueError, match=next(iter(fields))):
            check_no_state_fields(_plan(**fields))


def test_executor_refuses_a_plan_without_state_slots(setup) -> None:
    _, path, _, _ = setup
    llm = make_llm(path)
    with pytest.raises(ValueError, match="state_slots"):
        llm.engine.executor.execute(_plan())


def test_copies_between_entries_gather_a_bounded_chunk_at_a_time(tmp_path, monkeypatch) -> None:
    """``LinearStates.copy`` (restores from snapshots, kept drafts) equals one gather and one
    scatter, and gathers at most ``COPY_CHUNK_BYTES`` of entries at once: 256 restores in one
    step at Qwen3.5-9B's shapes gathered 12 GiB at once and ran out of GPU memory."""
    from torch.overrides import TorchFunctionMode

    from minivllm.config import ModelConfig
    from minivllm.executor import linear_state
    from tests.model.test_qwen3_5 import write_config

    config = ModelConfig.from_hf_json(write_config(tmp_path, "Qwen3_5ForCausalLM"))
    states = linear_state.LinearStates(config, StateLayout(num_slots=6, num_snapshots=5), torch.float32,
                                       torch.device("cpu"), hidden=True)
    gen = torch.Generator().manual_seed(0)
    for t in states._tensors:
        t.copy_(torch.randn(t.shape, generator=gen))
    entry_bytes = linear_state.state_bytes(config, torch.float32, hidden=True)
    assert states.entry_bytes == entry_bytes
    monkeypatch.setattr(linear_state, "COPY_CHUNK_BYTES", 2 * entry_bytes + 1)   # two rows a chunk
    src = torch.tensor([6, 7, 2, 10, 8])     # snapshots into slots, and slot 2 kept as it is
    dst = torch.tensor([0, 1, 2, 3, 5])
    want = [t.clone() for t in states._tensors]
    for w, t in zip(want, states._tensors):
        dim = 0 if t is states.hidden else 1
        w.index_copy_(dim, dst, w.index_select(dim, src))

    gathered: list[int] = []

    class Gathers(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.index_select:
                gathered.append(len(args[2]))
            return func(*args, **(kwargs or {}))

    with Gathers():
        states.copy(src, dst)
    assert all(torch.equal(w, t) for w, t in zip(want, states._tensors))
    assert gathered == [2, 2, 2, 2, 2, 2, 1, 1, 1], gathered
