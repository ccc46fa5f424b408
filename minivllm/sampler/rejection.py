"""Rejection sampling of drafts: the tokens kept follow the target model's distribution exactly.

A row with d drafts x_1..x_d is scored at d + 1 positions. With p_j the distribution the
sampler would draw from at position j (temperature, top-k, top-p, min-p applied:
``target_probs``) and q_j the proposer's (one-hot at x_{j+1} for proposers without
probabilities, such as n-gram lookup):

- draft x_{j+1} is kept with probability min(1, p_j(x) / q_j(x)), in order, and the first
  refusal, at j, ends the run;
- the row's own token is then drawn from norm(max(0, p_j - q_j)) (the correction), or,
  after all d drafts, from p_d (the bonus).

Each token of the run then follows p (Leviathan et al., 2023, "Fast inference from
transformers via speculative decoding"). A greedy row's p is one-hot at its argmax: a
draft is kept iff it is the argmax, and the token after is the argmax, as without drafts.

``rejection_sample`` is the torch reference (any q; randomness comes in as uniforms).
``sample_drafted`` is what the executor runs for one-hot q: acceptance from the filtered
log-softmax, then the token after the kept drafts drawn by the sampler itself (the fused
Triton pass on CUDA), from p with the refused draft banned, which for one-hot q is
norm(max(0, p - q)); the filters' floor is taken before the ban, so it is p's.
"""

from __future__ import annotations

import torch

import dataclasses

from minivllm.sampler.sampler import Sampler, SamplingTensors, apply_filters, filter_floor


def target_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The distributions (N, V) float32 the sampler draws from, one per row of ``logits``
    (N, V): one-hot at the argmax on greedy rows, else ``softmax`` of the filtered
    ``logits / T``."""
    logits = logits.float()
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if t.all_greedy:
        return greedy
    probs = apply_filters(logits / t.temperature[:, None], t).softmax(-1)
    return torch.where(t.greedy[:, None], greedy, probs)


def rejection_sample(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                     accept_u: torch.Tensor, draw_u: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep a prefix of each row's drafts and draw its own token after it: ``accept`` then
    ``draw_after``.

    Args:
        probs: (R, k + 1, V) the target's p_j at each row's positions 0..k (rows with fewer
            drafts: what follows position d is ignored).
        drafts: (R, k) int64, the drafts (padding past a row's d is ignored).
        num_drafts: (R,) int64 d per row, 0..k.
        accept_u: (R, k) uniforms in (0, 1), one per acceptance test.
        draw_u: (R, V) uniforms in (0, 1) for the row's own token (Gumbel-max).
        draft_probs: (R, k, V) q_j, or None: one-hot at the drafts.

    Returns:
        (tokens (R,), accepted (R,)) int64: the row's own token and how many drafts it kept.
    """
    accepted = accept(probs, drafts, num_drafts, accept_u, draft_probs)
    return draw_after(probs, drafts, num_drafts, accepted, draw_u, draft_probs), accepted


def accept(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, accept_u: torch.Tensor,
           draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """How many drafts each row keeps (R,) int64: draft j + 1 while ``u_j * q_j(x) < p_j(x)``."""
    k = drafts.shape[1]
    valid = torch.arange(k, device=probs.device)[None, :] < num_drafts[:, None]          # (R, k)
    p_x = probs[:, :k].gather(-1, drafts[..., None])[..., 0]                              # (R, k)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, drafts[..., None])[..., 0]
    kept = (accept_u * q_x < p_x) & valid
    return kept.to(torch.int64).cumprod(1).sum(1)


def draw_after(probs: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor, accepted: torch.Tensor,
               draw_u: torch.Tensor, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's own token (R,) int64 after its ``accepted`` drafts: from norm(max(0, p - q))
    at the refused position, or from p_d after all d."""
    r, k1, v = probs.shape
    k = k1 - 1
    rows = torch.arange(r, device=probs.device)
    p = probs[rows, accepted]                                                             # (R, V)
    if k:
        at = accepted.clamp(max=k - 1)
        q = (torch.nn.functional.one_hot(drafts[rows, at], v).to(p.dtype) if draft_probs is None
             else draft_probs[rows, at])
        p = torch.where((accepted < num_drafts)[:, None], (p - q).clamp(min=0), p)
    return (p.log() - torch.log(-torch.log(draw_u))).argmax(-1)


def sample_drafted(sampler: Sampler, logits: torch.Tensor, t: SamplingTensors, drafts: torch.Tensor,
                   num_drafts: torch.Tensor, accept_u: torch.Tensor, step_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of R drafted rows, drafts from a proposer without probabilities.

    Args:
        logits: (R, k + 1, V) raw logits (masked where a grammar masks) at each row's positions.
        t: sampling settings of the R * (k + 1) (row, position) pairs, row-major, each keyed by
            the position of the token it would sample (``SamplingTensors.build``).
        drafts, num_drafts, accept_u: as ``rejection_sample``'s.
        step_seed: keys the unseeded rows' draws (``Sampler.next_step_seed``).

    Returns:
        (tokens (R,), accepted (R,)) int64.
    """
    r, k1, v = logits.shape
    k = k1 - 1
    flat = logits.reshape(r * k1, v)
    floor = filter_floor(flat, t)                                                        # (R * (k + 1),) or None
    rows = torch.arange(r, device=logits.device)
    valid = torch.arange(k, device=logits.device)[None, :] < num_drafts[:, None]
    if k:
        best = flat.argmax(-1).view(r, k1)[:, :k]
        p_x = (drafts == best).float()                                                   # greedy rows: one-hot p
        if not t.all_greedy:
            scaled = flat.float() / t.temperature[:, None]
            if floor is not None:
                scaled = scaled.masked_fill(flat < floor[:, None], float("-inf"))
            logp = scaled.log_softmax(-1).view(r, k1, v)[:, :k]
            sampled = logp.gather(-1, drafts[..., None])[..., 0].exp()                   # (R, k)
            p_x = torch.where(t.greedy.view(r, k1)[:, :k], p_x, sampled)
        accepted = ((accept_u < p_x) & valid).to(torch.int64).cumprod(1).sum(1)
    else:
        accepted = torch.zeros(r, dtype=torch.int64, device=logits.device)
    at = rows * k1 + accepted                                                            # (R,) rows of flat
    own = flat[at]                                                                       # (R, V) a copy
    if k:
        refused = accepted < num_drafts
        x = drafts.gather(1, accepted.clamp(max=k - 1)[:, None])                        # (R, 1)
        banned = torch.where(refused[:, None], float("-inf"), own.gather(1, x))
        own.scatter_(1, x, banned.to(own.dtype))
    # Row i's settings at its position ``accepted[i]`` (its seed keyed by that token's position);
    # the draw reads no ``seeded_rows`` (the reference sampler's).
    picked = dataclasses.replace(t, temperature=t.temperature[at], top_k=t.top_k[at], top_p=t.top_p[at],
                                 log_min_p=t.log_min_p[at], greedy=t.greedy[at], seeded=t.seeded[at],
                                 seed_keys=t.seed_keys[at])
    return sampler.draw(own, picked, None if floor is None else floor[at], step_seed), accepted
