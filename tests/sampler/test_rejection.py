"""Rejection sampling of drafts keeps the target's distribution: over many draws, the first
token of a row (its kept draft, or its own token where the draft was refused) is distributed
as p, for one-hot q (n-gram) and a full q (a draft model), under temperature, top-k, top-p
and min-p; a sampler that skips the correction, or draws it from q in place of p, is
measurably off; greedy rows keep exactly the argmax run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm.sampler.rejection import rejection_sample, target_probs
from minivllm.sampler.sampler import SamplingTensors
from minivllm.sampling import SamplingParams

V = 8
DRAWS = 200_000
# Total variation between the empirical and the true distribution over V = 8 outcomes at
# 200,000 draws: its expectation is below sum_i sqrt(p_i (1 - p_i) / n) / 2 <= 0.0045; the
# broken samplers below are off by 0.05 or more.
TV_BOUND = 0.01


def _tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    freq = torch.bincount(tokens, minlength=V).double() / tokens.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


def _first_tokens(p: torch.Tensor, q: torch.Tensor | None, draft_token: torch.Tensor, sampler=rejection_sample,
                  seed: int = 0) -> torch.Tensor:
    """DRAWS rows, one draft each (drawn from q, or the given token), target p at both positions:
    the run's first token."""
    g = torch.Generator().manual_seed(seed)
    probs = p.expand(DRAWS, 2, V)
    drafts = draft_token[:, None]
    tokens, accepted = sampler(probs, drafts, torch.ones(DRAWS, dtype=torch.int64),
                               torch.rand(DRAWS, 1, generator=g).clamp(1e-7, 1 - 1e-7),
                               torch.rand(DRAWS, V, generator=g).clamp(1e-7, 1 - 1e-7),
                               None if q is None else q.expand(DRAWS, 1, V))
    return torch.where(accepted == 1, drafts[:, 0], tokens)


def _skip_correction(probs, drafts, num_drafts, accept_u, draw_u, draft_probs=None):
    """Broken: a refused draft's row draws from p itself, not from norm(max(0, p - q))."""
    tokens, accepted = rejection_sample(probs, drafts, num_drafts, accept_u, draw_u, draft_probs)
    p = probs[torch.arange(len(accepted)), accepted]
    return (p.log() - torch.log(-torch.log(draw_u))).argmax(-1), accepted


def _draws_from_q(probs, drafts, num_drafts, accept_u, draw_u, draft_probs=None):
    """Broken: the correction drawn from q where p belongs."""
    flipped = probs.clone()
    if draft_probs is not None:
        flipped[:, 0] = draft_probs[:, 0]
    return rejection_sample(flipped, drafts, num_drafts, accept_u, draw_u, draft_probs)


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.8])
SETTINGS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=1.0, min_p=0.2)]


@pytest.mark.parametrize("params", SETTINGS, ids=["plain", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("proposer", ["one-hot", "full q"])
def test_the_first_token_follows_the_target(params: SamplingParams, proposer: str) -> None:
    t = SamplingTensors.build([params], [0], V, "cpu")
    p = target_probs(LOGITS[None], t)[0]
    g = torch.Generator().manual_seed(1)
    if proposer == "one-hot":
        q = None
        draft = torch.full((DRAWS,), int(LOGITS.argmax()), dtype=torch.int64)  # a likely guess
    else:
        q = torch.softmax(torch.tensor([0.0, 2.0, 0.5, 1.0, -1.0, 0.3, 1.2, -0.2]), -1)
        draft = torch.multinomial(q, DRAWS, replacement=True, generator=g)
    assert _tv(_first_tokens(p, q, draft), p) < TV_BOUND
    for broken in (_skip_correction, _draws_from_q):
        if broken is _draws_from_q and q is None:
            continue  # one-hot q: its "correction" is degenerate, _skip_correction shows the point
        assert _tv(_first_tokens(p, q, draft, broken), p) > 3 * TV_BOUND, broken.__name__


def test_greedy_rows_keep_exactly_the_argmax_run() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 4, V)  # 3 rows, 3 drafts each + 1
    t = SamplingTensors.build([SamplingParams(temperature=0)] * 12, [0] * 12, V, "cpu")
    probs = target_probs(logits.view(12, V), t).view(3, 4, V)
    best = logits.argmax(-1)                                   # (3, 4)
    drafts = best[:, :3].clone()
    drafts[1, 1] = (drafts[1, 1] + 1) % V                      # row 1: its second draft wrong
    drafts[2, 0] = (drafts[2, 0] + 1) % V                      # row 2: its first
    tokens, accepted = rejection_sample(probs, drafts, torch.tensor([3, 3, 2]), torch.rand(3, 3), torch.rand(3, V))
    assert accepted.tolist() == [3, 1, 0]
    assert tokens.tolist() == [int(best[0, 3]), int(best[1, 1]), int(best[2, 0])]


def test_rows_of_fewer_drafts_and_none() -> None:
    """A row with no drafts draws from p_0; padding past a row's d is never read."""
    p = torch.softmax(LOGITS, -1)
    probs = torch.stack([p, torch.full((V,), float("nan"))])[None].expand(DRAWS, 2, V)
    g = torch.Generator().manual_seed(2)
    tokens, accepted = rejection_sample(probs, torch.zeros(DRAWS, 1, dtype=torch.int64),
                                        torch.zeros(DRAWS, dtype=torch.int64),
                                        torch.rand(DRAWS, 1, generator=g), torch.rand(DRAWS, V, generator=g).clamp(1e-7))
    assert not accepted.any() and _tv(tokens, p) < TV_BOUND
    assert np.isfinite(tokens.numpy()).all()


@pytest.mark.parametrize("params", SETTINGS, ids=["plain", "top_k", "top_p", "min_p"])
def test_the_samplers_road_follows_the_target(params: SamplingParams) -> None:
    """``sample_drafted`` (acceptance from the filtered log-softmax, the token after drawn by
    the sampler with the refused draft banned): the first token is distributed as p."""
    from minivllm.ops.dispatch import Ops
    from minivllm.sampler.rejection import sample_drafted
    from minivllm.sampler.sampler import Sampler

    p = target_probs(LOGITS[None], SamplingTensors.build([params], [0], V, "cpu"))[0]
    sampler = Sampler(Ops.build("torch", torch.device("cpu"), torch.float32))
    t = SamplingTensors.build([params] * (2 * DRAWS), np.zeros(2 * DRAWS, dtype=np.int64), V, "cpu")
    draft = torch.full((DRAWS, 1), int(LOGITS.argmax()), dtype=torch.int64)
    u = torch.rand(DRAWS, 1, generator=torch.Generator().manual_seed(3))
    tokens, accepted = sample_drafted(sampler, LOGITS.expand(DRAWS, 2, V).contiguous(), t, draft,
                                      torch.ones(DRAWS, dtype=torch.int64), u, step_seed=11)
    first = torch.where(accepted == 1, draft[:, 0], tokens)
    assert _tv(first, p) < TV_BOUND
    assert not ((accepted == 0) & (tokens == draft[:, 0])).any()  # a refused draft is never drawn again


def test_the_samplers_road_on_triton_draws_what_torch_draws() -> None:
    """The same drafted rows through the Triton sampler (interpreter) and the torch one: the same
    tokens, seeded and unseeded, greedy and filtered rows mixed."""
    from minivllm.ops.dispatch import Ops
    from minivllm.sampler.rejection import sample_drafted
    from minivllm.sampler.sampler import Sampler

    g = torch.Generator().manual_seed(4)
    r, k, v = 6, 3, 40
    logits = torch.randn(r, k + 1, v, generator=g) * 2
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0), SamplingParams(top_k=5),
              SamplingParams(top_p=0.7, seed=9), SamplingParams(min_p=0.1), SamplingParams(temperature=1.5)]
    t = SamplingTensors.build([q for q in params for _ in range(k + 1)], np.tile(np.arange(k + 1), r) + 20, v, "cpu")
    drafts = logits[:, :k].argmax(-1)
    drafts[::2, 1] = (drafts[::2, 1] + 1) % v
    num = torch.tensor([3, 3, 2, 1, 0, 3])
    u = torch.rand(r, k, generator=g)
    got = [sample_drafted(Sampler(Ops.build(name, torch.device("cpu"), torch.float32)), logits, t, drafts, num, u, 5)
           for name in ("torch", "triton")]
    assert got[0][1].tolist() == got[1][1].tolist() and got[0][0].tolist() == got[1][0].tolist()
