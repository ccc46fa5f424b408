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

This is the torch reference; randomness comes in as uniforms, so a caller keys them as it
keys the sampler's (seeded rows by seed and position).
"""

from __future__ import annotations

import torch

from minivllm.sampler.sampler import SamplingTensors, apply_filters


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
