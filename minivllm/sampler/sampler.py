"""The sampler: penalties, greedy, temperature, top-k, top-p and min-p, per row, in one batch, no host sync.

Per-row settings travel as tensors (``SamplingTensors``, one host->device copy
per step), so one batch mixes greedy and random rows with different filters.
Nothing here reads a device value on the host (no ``.item()``, no ``nonzero()``,
no branch on a device value): the executor keeps the sampled ids on the device.

Penalties (``minivllm/sampler/penalties.py``) come first, when a row has any: they
turn the raw logits into a float32 copy that every path below then samples from
(greedy rows included); the caller keeps the raw logits for log-probabilities.

Paths, from cheapest:

- every row greedy: ``argmax`` of the logits as they are (exact in bf16; no copy). The fused
  pass below is faster in a CUDA graph but not end to end (``docs/tuning.md``, "Sampler"),
  so ``argmax`` stays;
- otherwise one fused pass (``minivllm/kernels/gumbel_sample.py``): each row's
  ``argmax(logits / T + g)`` with Gumbel noise ``g = -log(-log(U))`` made in the
  kernel, greedy rows taking the plain argmax in the same launch. The Gumbel-max
  trick draws from ``softmax(logits / T)``; a filtered-out token gets ``-inf`` and,
  as ``U`` is strictly inside (0, 1) so ``g`` is finite, can never win.
- top-k, top-p and min-p each keep the tokens whose logit is at least a per-row
  *floor* (the k-th largest logit; the logit where the top-k-renormalised mass of
  ``softmax(logits / T)`` reaches top_p; ``max + T * log(min_p)``, i.e.
  ``p >= min_p * p_max``). The floors come from the few largest logits
  (``torch.topk`` with k = the batch's largest top_k, when every top-p row also
  has a top_k <= ``MAX_CANDIDATES``), else from one full sort; the fused pass then
  applies them. Ties at a floor are all kept (as vLLM does). A floor is compared
  with the raw logits, not with ``logits / T``: a top-k / top-p floor is one of the
  row's own logits, and min_p = 1 gives exactly the max, so the kept set never
  depends on how the compiled floor code and the kernel each round a division.

Seeded rows draw ``U`` from a counter-based hash of (seed, position of the token
being sampled, vocab index), so a request's tokens depend only on its own seed
and positions, not on the batch it shares, the order of rows or the steps it was
chunked into. Unseeded rows hash (row, step seed) instead: the step seed is a
plain host int, by default a counter advanced per call and keyed by the
executor's generator seed, so drawing it never waits for the device.

Under tensor parallelism each rank holds a vocab shard of the logits. Rows that need
only greedy and temperature (no penalty, no floor) are sampled from the shards
(``forward_vocab_parallel``): each rank finds its shard's best (value, global index),
the ranks all-gather those S pairs instead of the (S, V) logits, and every rank picks
the same best pair, the token the gathered row would have given (the noise is keyed by
global index; ties go to the smallest index in both).

``reference_sample`` is the previous all-torch path (full sort, (S, V) noise from
the generator); the tests check the fast path against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import Sequence

import numpy as np
import torch
from torch import nn

from minivllm.ops.dispatch import Ops, hashed_uniform
from minivllm.sampler.penalties import PenaltyTensors, apply_penalties
from minivllm.sampling import SamplingParams, is_greedy_temperature

__all__ = ["MAX_CANDIDATES", "Sampler", "SamplingTensors", "apply_filters", "filter_floor", "pick_candidate",
           "hashed_uniform", "reference_sample", "row_key", "row_keys"]

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_UNIFORM_BITS = 23
# Largest top_k served from ``torch.topk`` candidates; beyond it (or top-p without
# top-k) the floors come from a full sort of the vocab.
MAX_CANDIDATES = 2048
# One pass over the params: every attribute a row needs.
_ROW_ATTRS = attrgetter("temperature", "top_k", "top_p", "min_p", "seed")


# ----------------------------------------------------------------------------- seeds (host)

def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` (S, V) with -inf where ``bitmask`` (int32 (S, W), W * 32 >= V; token t is
    allowed iff bit t % 32 of word t // 32 is set: ``engine/grammar.py``) disallows a token."""
    s, v = logits.shape
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == s and bitmask.shape[1] * 32 >= v, bitmask.shape
    # Bytes, not words: a (S, 4W, 8) uint8 unpacking is a quarter of an int32 one's memory.
    # Little-endian words: byte j of a row holds tokens 8j .. 8j + 7, lowest bit first.
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(s, -1)[:, :v].bool()  # (S, V)
    return logits.masked_fill(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` (S, V) with each row's ``SamplingParams.logit_bias`` added and, where it
    has ``allowed_token_ids``, every other token at -inf: a copy, or ``logits`` itself when
    no row has either."""
    if not any(p.shapes_logits for p in params):
        return logits
    out = logits.clone()
    rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    if rows:
        cols = [t for p in params for t, _ in p.logit_bias]
        bias = [b for p in params for _, b in p.logit_bias]
        index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)
        out.index_put_((index[0], index[1]), torch.tensor(bias, dtype=out.dtype).to(logits.device), accumulate=True)
    limited = [(r, p.allowed_token_ids) for r, p in enumerate(params) if p.allowed_token_ids is not None]
    if limited:
        keep = torch.zeros(len(limited), logits.shape[1], dtype=torch.bool)
        for i, (_, ids) in enumerate(limited):
            keep[i, list(ids)] = True
        rows_t = torch.tensor([r for r, _ in limited], dtype=torch.int64).to(logits.device)
        out[rows_t] = out[rows_t].masked_fill(~keep.to(logits.device), float("-inf"))
    return out


def _splitmix64(x: int) -> int:
    """Host-side 64-bit mix of a Python int (splitmix64 finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` on a uint64 array (array arithmetic wraps mod 2**64 without warnings)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def row_key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys for the token sampled at ``position`` by a request seeded ``seed``."""
    k = _splitmix64(_splitmix64(seed & _MASK64) ^ position)
    return k & _MASK32, k >> 32


def row_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``row_key`` of many rows: seeds (R,) uint64 (already ``& 2**64-1``), positions (R,) -> (R, 2) int64."""
    k = _splitmix64_np(_splitmix64_np(seeds.astype(np.uint64)) ^ positions.astype(np.uint64))
    return np.stack([k & np.uint64(_MASK32), k >> np.uint64(32)], axis=1).astype(np.int64)


# ----------------------------------------------------------------------------- per-row settings

@dataclass(frozen=True)
class _HostRows:
    """Per-row settings written straight into one host byte buffer (pinned for CUDA).

    Layout, int64 first so every group's byte offset stays aligned:
    ``ints`` int64 (3S + R,) = top_k (S,) | seed_keys (S, 2) | seeded_rows (R,);
    ``floats`` float32 (3, S) = temperature | top_p | log_min_p;
    ``flags`` bool (2, S) = greedy | seeded. Greedy rows get temperature 1 and
    every filter disabled (top_k V, top_p +inf, log_min_p -inf), as do disabled
    filters of random rows.
    """

    buffer: torch.Tensor  # uint8, the whole layout
    ints: np.ndarray      # views into ``buffer``
    floats: np.ndarray
    flags: np.ndarray

    @staticmethod
    def gather(params: Sequence[SamplingParams], positions: np.ndarray, vocab_size: int,
               pin: bool) -> "_HostRows":
        """One pass over ``params`` (attrgetter, in C), then numpy only."""
        s = len(params)
        temp, top_k, top_p, min_p, seeds = list(zip(*map(_ROW_ATTRS, params))) or [()] * 5
        temperature = np.array(temp, dtype=np.float64)
        greedy = is_greedy_temperature(temperature)
        rand = ~greedy
        seeded_rows = np.zeros(0, dtype=np.int64)
        if seeds.count(None) != s:  # the common all-unseeded batch skips this pass
            seeded_rows = np.flatnonzero(rand & np.array([x is not None for x in seeds], dtype=bool))
        rows = _HostRows.allocate(s, len(seeded_rows), pin)
        k = np.array(top_k, dtype=np.int64)
        rows.ints[:s] = np.where(rand & (k > 0) & (k < vocab_size), k, vocab_size)
        rows.ints[s:3 * s] = 0
        if len(seeded_rows):
            seed_vals = np.array([seeds[i] & _MASK64 for i in seeded_rows], dtype=np.uint64)
            rows.ints[s:3 * s].reshape(s, 2)[seeded_rows] = row_keys(seed_vals, positions[seeded_rows])
            rows.ints[3 * s:] = seeded_rows
        rows.floats[0] = np.where(greedy, 1.0, temperature)
        # A top_p below float32's smallest normal would round to 0 and keep nothing: it keeps
        # the most likely token, as any top_p that small does.
        p = np.maximum(np.array(top_p, dtype=np.float64), np.finfo(np.float32).tiny)
        rows.floats[1] = np.where(rand & (p < 1), p, np.inf)
        m = np.array(min_p, dtype=np.float64)
        log_min_p = np.full(s, -np.inf)
        np.log(m, out=log_min_p, where=rand & (m > 0))  # min_p 0 (disabled) stays -inf
        rows.floats[2] = log_min_p
        rows.flags[0] = greedy
        rows.flags[1] = False
        rows.flags[1, seeded_rows] = True
        return rows

    @staticmethod
    def allocate(s: int, r: int, pin: bool) -> "_HostRows":
        """An uninitialised buffer for S rows, R of them seeded, and its three typed views."""
        # Pinned memory comes from torch's caching host allocator, which keeps a
        # block until the copy reading it is done: the copy can be asynchronous.
        n_ints, n_floats = 8 * (3 * s + r), 4 * 3 * s
        buffer = torch.empty(n_ints + n_floats + 2 * s, dtype=torch.uint8, pin_memory=pin)
        raw = buffer.numpy()
        return _HostRows(buffer=buffer, ints=raw[:n_ints].view(np.int64),
                         floats=raw[n_ints:n_ints + n_floats].view(np.float32).reshape(3, s),
                         flags=raw[n_ints + n_floats:].view(np.bool_).reshape(2, s))

    @property
    def top_k(self) -> np.ndarray:
        return self.ints[:self.flags.shape[1]]

    def to_device(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Copy the buffer to ``device`` once; return the ``SamplingTensors`` views of the copy."""
        s = self.flags.shape[1]
        n_ints, n_floats = self.ints.nbytes, self.floats.nbytes
        dev = self.buffer.to(device, non_blocking=True)
        ints = dev[:n_ints].view(torch.int64)
        top_k, seed_keys, seeded_rows = ints.split([s, 2 * s, ints.shape[0] - 3 * s])
        temperature, top_p, log_min_p = dev[n_ints:n_ints + n_floats].view(torch.float32).view(3, s).unbind(0)
        greedy, seeded = dev[n_ints + n_floats:].view(torch.bool).view(2, s).unbind(0)
        return dict(temperature=temperature, top_k=top_k, top_p=top_p, log_min_p=log_min_p, greedy=greedy,
                    seeded=seeded, seed_keys=seed_keys.view(s, 2), seeded_rows=seeded_rows)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling settings of S sampling rows, on the logits' device.

    All tensors are views of one buffer copied in one host->device transfer. The
    flags are host values computed from the params (numpy), so unused filters
    cost nothing and choosing a path never reads the device.
    """

    temperature: torch.Tensor   # float32 (S,): 1 on greedy rows (their result is argmax anyway)
    top_k: torch.Tensor         # int64 (S,): vocab size where disabled
    top_p: torch.Tensor         # float32 (S,): +inf where disabled (top_p == 1)
    log_min_p: torch.Tensor     # float32 (S,): log(min_p), -inf where disabled
    greedy: torch.Tensor        # bool (S,)
    seeded: torch.Tensor        # bool (S,): random rows with a per-request seed
    seed_keys: torch.Tensor     # int64 (S, 2): ``row_key(seed, position)`` on seeded rows, 0 elsewhere
    seeded_rows: torch.Tensor   # int64 (R,): indices of the seeded rows
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # k of the torch.topk that yields every top-k / top-p floor; the vocab size:
    # sort it all; 0: no top-k / top-p row.
    num_candidates: int

    @property
    def vocab_parallel_ok(self) -> bool:
        """No row filters, so each can be sampled from vocab shards (``forward_vocab_parallel``)."""
        return self.num_candidates == 0 and not self.any_min_p

    @staticmethod
    def build(params: Sequence[SamplingParams], positions: Sequence[int] | np.ndarray,
              vocab_size: int, device: torch.device | str) -> "SamplingTensors":
        """Gather per-row settings on the host and move them to ``device`` in one copy.

        Args:
            params: sampling params of each sampling row.
            positions: per row, the position the sampled token will take (the
                counter of seeded rows: the sequence's length before it).
            vocab_size: V; a disabled or larger top_k becomes V.
            device: where the logits live.

        Raises:
            ValueError: ``params`` and ``positions`` differ in length.
        """
        if len(params) != len(positions):
            raise ValueError(f"{len(params)} sampling params for {len(positions)} positions")
        device = torch.device(device)
        rows = _HostRows.gather(params, np.asarray(positions, dtype=np.int64), vocab_size,
                                pin=device.type == "cuda")
        views = rows.to_device(device)
        top_k_on = rows.top_k < vocab_size  # greedy rows are never filtered
        top_p_on = rows.floats[1] <= 1
        return SamplingTensors(
            **views,
            all_greedy=bool(rows.flags[0].all()),
            any_top_k=bool(top_k_on.any()),
            any_top_p=bool(top_p_on.any()),
            any_min_p=bool((rows.floats[2] > -np.inf).any()),
            num_candidates=_num_candidates(rows.top_k, top_k_on | top_p_on, vocab_size),
        )


def _num_candidates(top_k: np.ndarray, filtered: np.ndarray, vocab_size: int) -> int:
    """The k of the ``topk`` that holds every row's top-k / top-p cut (V: sort all; 0: none)."""
    if not filtered.any():
        return 0
    k = int(top_k[filtered].max())  # a top-p row without top_k counts as V
    return k if k <= MAX_CANDIDATES else vocab_size


# ----------------------------------------------------------------------------- filters

def _floor_from_sorted(top: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                       top_p: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Per-row floor on the raw logits (S,) float32 from each row's K largest ``top`` (S, K), descending.

    Holds for every row whose top_k <= K, and for rows with top-p only when K = V.
    About a dozen small ops on (S, K), run eagerly: ``layers.fuse.fused`` would
    merge them, but dynamic-shape compiles specialise S = 1 and K = 1, and a
    recompile in the middle of serving stalls for seconds.
    """
    num = top.shape[1]
    raw = top.float()                                            # (S, K)
    k = top_k.clamp(max=num)
    kth = raw.gather(1, (k - 1)[:, None])[:, 0]
    floor = torch.where(top_k > num, float("-inf"), kth)  # top_k > K only where disabled
    in_top_k = torch.arange(num, device=top.device)[None, :] < k[:, None]
    probs = (raw / temperature[:, None]).masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # A prefix (mass_before grows with rank), never empty (the first has mass_before 0 < top_p).
    num_kept = (in_top_k & (mass_before < top_p[:, None])).sum(dim=-1)
    cut = raw.gather(1, (num_kept - 1)[:, None])[:, 0]
    floor = torch.maximum(floor, torch.where(top_p <= 1, cut, float("-inf")))
    return torch.maximum(floor, raw[:, 0] + temperature * log_min_p)


def filter_floor(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor | None:
    """Per-row threshold (S,) float32 on the logits below which top-k / top-p / min-p drop a token.

    ``None`` when no row filters. Division by a positive T keeps the order, so the
    candidates are picked from the logits as they are (no scaled (S, V) float copy).
    """
    vocab = logits.shape[1]
    if t.num_candidates:
        k = min(t.num_candidates, vocab)
        if k < vocab:
            top = logits.topk(k, dim=-1, sorted=True).values  # (S, k)
        else:
            top = logits.sort(dim=-1, descending=True).values  # (S, V)
        return _floor_from_sorted(top, t.temperature, t.top_k, t.top_p, t.log_min_p)
    if t.any_min_p:
        return logits.amax(dim=-1).float() + t.temperature * t.log_min_p
    return None


def apply_filters(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Set every token outside a row's top-k, top-p or min-p set to ``-inf`` (reference).

    Top-k first; top-p over the distribution renormalised to the top-k set
    (as vLLM does); min-p keeps tokens with ``p >= min_p * p_max``, i.e.
    ``logit >= max_logit + log(min_p)``, which renormalisation does not change.
    At a tie on the top-k / top-p boundary it keeps exactly k (resp. the sorted
    prefix), where ``filter_floor`` keeps every tied token.

    Args:
        logits: (S, V) float32, already divided by the temperature.
        t: the rows' settings.

    Returns:
        (S, V) the filtered logits (a new tensor when any filter applies).
    """
    if t.any_top_k or t.any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (S, V) each
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        keep = ranks[None, :] < t.top_k[:, None]
        if t.any_top_p:
            probs = sorted_logits.masked_fill(~keep, -math.inf).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # The most likely token always stays: its mass_before is 0 < top_p.
            keep &= mass_before < t.top_p[:, None]
        keep = torch.zeros_like(keep).scatter_(1, order, keep)  # back to vocab order
        logits = logits.masked_fill(~keep, -math.inf)
    if t.any_min_p:
        floor = logits.max(dim=-1, keepdim=True).values + t.log_min_p[:, None]
        logits = logits.masked_fill(logits < floor, -math.inf)
    return logits


def reference_sample(logits: torch.Tensor, t: SamplingTensors,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """The previous all-torch sampler: full-sort filters, (S, V) uniforms from ``generator``.

    Seeded rows draw the same hashed uniforms as the fast path, so their tokens
    agree with it (up to ties at a filter boundary); unseeded rows follow the
    generator's stream instead of the step seed.
    """
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy_ids
    scaled = apply_filters(logits / t.temperature[:, None], t)
    bits = torch.randint(0, 1 << _UNIFORM_BITS, logits.shape, device=logits.device, generator=generator)
    u = (bits.float() + 0.5) / float(1 << _UNIFORM_BITS)
    if t.seeded_rows.numel():
        u[t.seeded_rows] = hashed_uniform(t.seed_keys[t.seeded_rows], logits.shape[1])
    gumbel = -torch.log(-torch.log(u))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(t.greedy, greedy_ids, sampled)


# ----------------------------------------------------------------------------- sampler

def pick_candidate(pairs: torch.Tensor) -> torch.Tensor:
    """The token ids (S,) int64 from every rank's (value, global column) pairs (world, S, 2),
    ranks in vocab order: the largest value, the smallest column on a tie (the first maximum
    over ranks holding ascending column ranges), as ``argmax`` over the whole row."""
    winner = pairs[:, :, 0].argmax(dim=0, keepdim=True)  # (1, S)
    return pairs[:, :, 1].gather(0, winner)[0].long()


class Sampler(nn.Module):
    """Samples one token per row of logits, without a host sync.

    Args:
        ops: the engine's dispatch point: the fused Triton pass or its torch reference
            (same tokens).
        generator: keys the unseeded rows' noise (its ``initial_seed``, read on the
            host); None: seed 0.
    """

    def __init__(self, ops: Ops, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.generator = generator
        self.num_steps = 0  # calls so far: the counter of the default step seeds
        self._counts: torch.Tensor | None = None  # the fused pass's per-row split counters (zeros)

    def next_step_seed(self) -> int:
        """A fresh 64-bit seed for this call's unseeded rows (host only; never touches the device)."""
        self.num_steps += 1
        base = self.generator.initial_seed() if self.generator is not None else 0
        return _splitmix64(_splitmix64(base & _MASK64) ^ self.num_steps)

    def forward(self, logits: torch.Tensor, t: SamplingTensors, step_seed: int | None = None,
                penalties: PenaltyTensors | None = None) -> torch.Tensor:
        """Sample from ``logits`` (S, V) -> token ids (S,) int64 on the logits' device.

        Greedy rows get exactly ``argmax`` (of the penalised logits where ``penalties``
        covers them). ``step_seed`` keys the unseeded rows (None: ``next_step_seed()``);
        seeded rows ignore it. ``logits`` is not modified.
        """
        if step_seed is None:
            step_seed = self.next_step_seed()
        if penalties is not None:
            logits = apply_penalties(logits, penalties)
        if t.all_greedy:
            return logits.argmax(dim=-1)
        floor = filter_floor(logits, t)
        return self.ops.gumbel_sample(logits, t.temperature, floor, t.greedy, t.seeded, t.seed_keys, step_seed,
                                      self._split_counts(logits))

    def forward_vocab_parallel(self, shard: torch.Tensor, t: SamplingTensors, col_offset: int,
                               group: "torch.distributed.ProcessGroup | None" = None,
                               step_seed: int | None = None) -> torch.Tensor:
        """Sample from this rank's vocab shard of the logits: the same token ids (S,) int64
        on every rank of ``group``, equal to ``forward`` on the gathered logits.

        Args:
            shard: (S, V_rank) logits of the global columns ``col_offset ..``; padding
                columns already dropped.
            t: the rows' settings; no row may filter (``vocab_parallel_ok``).
            group: the tensor-parallel group (None: the default one).
            step_seed: as ``forward`` (every rank draws the same counter).

        Raises:
            ValueError: a row filters (top-k / top-p / min-p need the whole row).
        """
        if step_seed is None:
            step_seed = self.next_step_seed()
        mine = self.shard_candidates(shard, t, col_offset, step_seed)
        world = torch.distributed.get_world_size(group)
        pairs = mine.new_empty(world * mine.shape[0], 2)  # rank-major, as the collective wants it
        torch.distributed.all_gather_into_tensor(pairs, mine, group=group)
        return pick_candidate(pairs.view(world, -1, 2))

    def shard_candidates(self, shard: torch.Tensor, t: SamplingTensors, col_offset: int,
                         step_seed: int) -> torch.Tensor:
        """This shard's best (value, global column) per row, as one (S, 2) float32 tensor (a
        column is exact in float32 below 2**24): the message ``forward_vocab_parallel`` gathers."""
        if not t.vocab_parallel_ok:
            raise ValueError("top-k / top-p / min-p rows need the whole logits row: gather the logits")
        return self.ops.gumbel_pairs(shard, t.temperature, t.greedy, t.seeded, t.seed_keys, step_seed, col_offset,
                                     t.all_greedy, self._split_counts(shard))

    def draw(self, logits: torch.Tensor, t: SamplingTensors, floor: torch.Tensor | None, step_seed: int) -> torch.Tensor:
        """``forward``'s draw with the filter ``floor`` given (computed before some tokens of
        ``logits`` were banned: rejection sampling's correction, ``sampler/rejection.py``)."""
        if t.all_greedy:
            return logits.argmax(dim=-1)
        return self.ops.gumbel_sample(logits, t.temperature, floor, t.greedy, t.seeded, t.seed_keys, step_seed,
                                      self._split_counts(logits))

    def _split_counts(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The fused pass's split counters for ``logits``' rows (None off Triton): one zeroed
        buffer kept across calls (each launch leaves it zero), replaced by a larger one when a
        batch outgrows it."""
        if not self.ops.triton:
            return None
        counts = self._counts
        if counts is None or counts.device != logits.device or counts.shape[0] < logits.shape[0]:
            counts = self._counts = torch.zeros(max(256, logits.shape[0]), dtype=torch.int32, device=logits.device)
        return counts
