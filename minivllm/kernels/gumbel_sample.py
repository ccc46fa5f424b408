"""Sample one token per row of logits in one pass: ``argmax(logits / T + g)``, g Gumbel noise.

Each program reads its slice of one row once (any float dtype), generates the
uniforms it needs *in the kernel* from a counter-based hash (no (S, V) noise
tensor in memory), and keeps a per-lane running (value, index) maximum. Greedy
rows in the same launch take the plain argmax of the logits. A per-row ``floor``
(optional) drops tokens whose logit is below it: top-k, top-p and min-p all
reduce to such a threshold (see ``minivllm/sampler/sampler.py``). It applies to
the raw logit, before the division by T, so the comparison cannot depend on how
two libraries round a division: a floor that *is* a row's logit keeps that token.

Noise: ``U = (hash(k0, k1, vocab index) >> 9 + 0.5) / 2**23`` strictly in (0, 1),
so ``g = -log(-log(U))`` is finite and a dropped token (``-inf``) never wins.
Seeded rows use their ``row_key(seed, position)`` as (k0, k1); unseeded rows a key
derived from the row index and a per-step seed the host passes as a plain int,
so the launch never reads a device value on the host.

Few rows leave most SMs idle with one program per row (a 151936-wide bf16 row is
300 KB), so the vocab is split over ``num_splits`` programs per row; each writes
its best (value, index) to a scratch row, then counts itself in on the row's
counter (an atomic add, acquire-release): the program that arrives last picks the
row's winner from the scratch row, writes it and sets the counter back to zero for
the next launch. One launch, where a torch reduction after it took three more
(argmax, two gathers). Ties go to the smallest index, as ``torch.argmax`` does.
The counters (int32, zero) outlive a launch: a caller launching often keeps one
buffer (``Sampler`` does); without one, a zeroed buffer is made per call.

Vocab-parallel (tensor parallelism): a rank holding the columns ``[col_offset,
col_offset + V_shard)`` of every row runs :func:`gumbel_best` on its shard with that
offset: the noise of a column depends on its *global* index, so each rank's winner is
the full row's winner restricted to its columns, and the row's token is the best of
the ranks' (value, index) pairs (``sampler/sampler.py``), the same token as sampling the
gathered row.

Torch reference: :func:`gumbel_sample_reference` (below), token-for-token the same
given the same keys (up to 1-ulp differences of ``log`` between libraries, which
can only matter on a near-exact tie of two perturbed logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minivllm.kernels._launch import (
    check_dtype, check_last_dim_contiguous, check_power_of_two, check_same_device, next_pow2,
)

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MASK32 = 0xFFFFFFFF
_UNIFORM_BITS = 23  # U = (k + 0.5) / 2**23 is exact in float32 and strictly in (0, 1)
_STEP_MASK = 0x7FFFFFFF  # step key halves stay < 2**31: Triton types them i32, never u32/i64
# Most programs per row. A constant, so that batches of every size share one compiled kernel
# (the split count itself is a plain argument): a compile per split count would stall a
# serving run whose batch sizes change every step.
MAX_SPLITS = 128


@dataclass(frozen=True)
class GumbelConfig:
    """Launch tunables of :func:`gumbel_sample` (``benchmarks/sampler.py --sweep`` times others;
    why these defaults: docs/tuning.md, "Sampler").

    Attributes:
        block: columns per loop iteration (a power of two; smaller for a short split).
        num_warps: warps per program at the full block.
        programs_per_sm: target programs per SM when choosing the split count
            (the hash makes the pass compute-heavy: enough warps must be resident).
        min_split_columns: fewest columns per program (below, launch and the
            cross-split reduction cost more than they save).
    """

    block: int = 1024
    num_warps: int = 8
    programs_per_sm: int = 8
    min_split_columns: int = 2048

    def __post_init__(self) -> None:
        check_power_of_two("block", self.block, 16)
        check_power_of_two("num_warps", self.num_warps)
        for name in ("programs_per_sm", "min_split_columns"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# ----------------------------------------------------------------------------- Triton

@triton.jit
def _mix32(x):
    """The 32-bit hash of ``_mix32_torch`` on uint32 (wrapping multiply == ``& 0xFFFFFFFF``)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton.jit
def _split_best(row_ptr, start, end, temperature, floor, k0, k1, col_offset,
                NOISE: tl.constexpr, BLOCK: tl.constexpr):
    """Per lane, the best (value, column) of the columns ``[start, end)`` of one row: the
    logit itself (greedy), or with ``NOISE`` the Gumbel-perturbed ``logit / T`` of the
    columns at or above ``floor``."""
    offs = tl.arange(0, BLOCK)
    best_val = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_idx = start + offs
    for col0 in range(start, end, BLOCK):
        cols = col0 + offs
        mask = cols < end
        z = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if NOISE:
            # Same arithmetic as the reference: the hash of the vocab index, an IEEE
            # round-to-nearest division like torch's (Triton's fp32 `/` need not be), two logs.
            h = _mix32(_mix32(_mix32((cols + col_offset).to(tl.uint32)) ^ k0) ^ k1)
            u = ((h >> (32 - 23)).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            scaled = tl.math.div_rn(z, temperature)
            z = tl.where(z >= floor, scaled + -tl.log(-tl.log(u)), float("-inf"))
        better = mask & (z > best_val)  # strict: an earlier column keeps a tie
        best_val = tl.where(better, z, best_val)
        best_idx = tl.where(better, cols, best_idx)
    return best_val, best_idx


@triton.jit(do_not_specialize=["step_lo", "step_hi", "col_offset", "out_offset"])
def _gumbel_sample_kernel(
    logits_ptr,                 # (S, V) float, last dim contiguous
    temperature_ptr,            # (S,) float32 (ignored on greedy rows)
    floor_ptr,                  # (S,) float32: drop logit < floor (read only if HAS_FLOOR)
    greedy_ptr, seeded_ptr,     # (S,) bool each
    keys_ptr,                   # (S, 2) int64: row_key of seeded rows, in [0, 2**32)
    split_val_ptr,              # (S, num_splits) float32 scratch; num_splits = grid axis 1
    split_idx_ptr,              # (S, num_splits) int32 scratch
    count_ptr,                  # (>= S,) int32: zero before the launch, zero after it
    out_val_ptr, out_idx_ptr,   # the row's winner: value (float32) and column + out_offset
    out_stride,                 # elements between two rows' outputs
    out_offset,                 # added to the winning column (its global index, or 0)
    stride_row, vocab_size, cols_per_split,
    step_lo, step_hi,           # int32 in [0, 2**31): this step's key for unseeded rows
    col_offset,                 # global index of column 0 (a vocab shard's start; else 0)
    HAS_FLOOR: tl.constexpr, BLOCK: tl.constexpr,
    MAX_SPLITS: tl.constexpr,   # a power of two >= num_splits (the module's MAX_SPLITS)
):
    # The split count is not a constexpr: it changes with the batch size, and
    # each value would compile another kernel.
    row = tl.program_id(0)
    split = tl.program_id(1)
    num_splits = tl.num_programs(1)
    greedy = tl.load(greedy_ptr + row)
    temperature = tl.load(temperature_ptr + row)
    floor = float("-inf")
    if HAS_FLOOR:
        floor = tl.load(floor_ptr + row)
    # Unseeded key: a bijection of the row index mixed with the step's key.
    k0 = _mix32(row.to(tl.uint32) ^ step_lo.to(tl.uint32))
    k1 = _mix32(k0 ^ step_hi.to(tl.uint32))
    seeded = tl.load(seeded_ptr + row)
    k0 = tl.where(seeded, tl.load(keys_ptr + 2 * row).to(tl.uint32), k0)
    k1 = tl.where(seeded, tl.load(keys_ptr + 2 * row + 1).to(tl.uint32), k1)

    start = split * cols_per_split
    end = tl.minimum(start + cols_per_split, vocab_size)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    if greedy:  # the plain argmax: no noise to make
        best_val, best_idx = _split_best(row_ptr, start, end, temperature, floor, k0, k1, col_offset,
                                         NOISE=False, BLOCK=BLOCK)
    else:
        best_val, best_idx = _split_best(row_ptr, start, end, temperature, floor, k0, k1, col_offset,
                                         NOISE=True, BLOCK=BLOCK)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, vocab_size), axis=0)
    if num_splits > 1:
        tl.store(split_val_ptr + row * num_splits + split, top)
        tl.store(split_idx_ptr + row * num_splits + split, idx)
        tl.debug_barrier()  # the stores above precede the release below
        arrived = tl.atomic_add(count_ptr + row, 1, sem="acq_rel")
        if arrived == num_splits - 1:  # the last of the row: every split's result is visible
            s = tl.arange(0, MAX_SPLITS)
            m = s < num_splits
            vals = tl.load(split_val_ptr + row * num_splits + s, mask=m, other=float("-inf"),
                           cache_modifier=".cg")
            idxs = tl.load(split_idx_ptr + row * num_splits + s, mask=m, other=vocab_size,
                           cache_modifier=".cg")
            top = tl.max(vals, axis=0)
            # Splits hold ascending columns: the smallest column among the best is the first.
            idx = tl.min(tl.where(vals == top, idxs, vocab_size), axis=0)
            tl.store(out_val_ptr + row * out_stride, top)
            tl.store(out_idx_ptr + row * out_stride, idx + out_offset)
            tl.store(count_ptr + row, 0)  # ready for the next launch (kernels of a stream run in order)
    else:
        tl.store(out_val_ptr + row * out_stride, top)
        tl.store(out_idx_ptr + row * out_stride, idx + out_offset)


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None,
                  greedy: torch.Tensor, seeded: torch.Tensor, seed_keys: torch.Tensor, step_seed: int,
                  num_splits: int | None = None, config: GumbelConfig | None = None,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
    """One token id per row (S,) int64: greedy rows argmax, others a Gumbel-max draw (the
    columns of :func:`gumbel_best`, which documents the arguments)."""
    return gumbel_best(logits, temperature, floor, greedy, seeded, seed_keys, step_seed,
                       num_splits=num_splits, config=config, counts=counts)[1]


def gumbel_best(
    logits: torch.Tensor,         # (S, V) bf16 / fp16 / fp32
    temperature: torch.Tensor,    # (S,) float32
    floor: torch.Tensor | None,   # (S,) float32 or None (no filter)
    greedy: torch.Tensor,         # (S,) bool
    seeded: torch.Tensor,         # (S,) bool
    seed_keys: torch.Tensor,      # (S, 2) int64
    step_seed: int,
    *,
    col_offset: int = 0,
    num_splits: int | None = None,
    config: GumbelConfig | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's winning (value (S,) float32, column (S,) int64): greedy rows the largest
    logit, others the largest ``logit / T + g`` (the Gumbel-max draw).

    A random row draws from ``softmax(logits / T)`` restricted to the tokens with
    ``logits >= floor``; its noise comes from ``seed_keys`` where ``seeded``,
    else from ``step_seed`` and the row index. One launch; never syncs the host.

    Args:
        col_offset: global index of column 0 when ``logits`` holds a vocab shard (the
            noise is keyed by global index); returned columns stay local.
        num_splits: programs per row (None: from ``config``; 1 off CUDA).
        config: launch tunables (None: the defaults).
        counts: (>= S,) int32 zeros on the logits' device, the splits' arrival counters,
            zero again when the launch ends (None: a zeroed buffer is made).

    Raises:
        TypeError: a dtype is wrong / ``step_seed`` is not an int.
        ValueError: shapes disagree, logits' last dim is strided, tensors live on
            different devices, or ``num_splits`` < 1.
    """
    _check_args(logits, temperature, floor, greedy, seeded, seed_keys, step_seed, col_offset)
    rows = logits.shape[0]
    value = torch.empty(rows, dtype=torch.float32, device=logits.device)
    column = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _launch(logits, temperature, floor, greedy, seeded, seed_keys, step_seed, col_offset, num_splits, config,
            counts, value, column, out_stride=1, out_offset=0)
    return value, column


def gumbel_pairs(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None,
                 greedy: torch.Tensor, seeded: torch.Tensor, seed_keys: torch.Tensor, step_seed: int, *,
                 col_offset: int = 0, num_splits: int | None = None, config: GumbelConfig | None = None,
                 counts: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gumbel_best` as one (S, 2) float32 tensor of (value, *global* column
    ``col_offset + column``), written by the launch itself: the message the vocab-parallel
    sampler all-gathers (a column is exact in float32 below 2**24). Arguments and errors
    as :func:`gumbel_best`; also ValueError when a global column would not be exact."""
    _check_args(logits, temperature, floor, greedy, seeded, seed_keys, step_seed, col_offset)
    rows = logits.shape[0]
    if logits.shape[1] + col_offset > 1 << 24:
        raise ValueError(f"vocab columns up to {logits.shape[1] + col_offset} are not exact in float32")
    pairs = torch.empty(rows, 2, dtype=torch.float32, device=logits.device)
    _launch(logits, temperature, floor, greedy, seeded, seed_keys, step_seed, col_offset, num_splits, config,
            counts, pairs[:, 0], pairs[:, 1], out_stride=2, out_offset=col_offset)
    return pairs


def _launch(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None, greedy: torch.Tensor,
            seeded: torch.Tensor, seed_keys: torch.Tensor, step_seed: int, col_offset: int,
            num_splits: int | None, config: GumbelConfig | None, counts: torch.Tensor | None,
            out_val: torch.Tensor, out_idx: torch.Tensor, out_stride: int, out_offset: int) -> None:
    """Launch :func:`_gumbel_sample_kernel` into ``out_val`` / ``out_idx`` (arguments checked by the caller)."""
    config = config or GumbelConfig()
    rows, vocab = logits.shape
    if num_splits is None:
        num_splits = choose_num_splits(rows, vocab, logits.device, config)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    block = max(16, min(config.block, next_pow2(triton.cdiv(vocab, num_splits))))
    cols_per_split = triton.cdiv(triton.cdiv(vocab, num_splits), block) * block
    num_splits = max(1, triton.cdiv(vocab, cols_per_split))  # rounding may leave fewer
    if rows == 0:
        return
    if counts is None:
        counts = torch.zeros(rows, dtype=torch.int32, device=logits.device)
    check_dtype("counts", counts, (torch.int32,))
    if counts.dim() != 1 or counts.shape[0] < rows or not counts.is_contiguous():
        raise ValueError(f"counts must be a contiguous (>= {rows},) int32, got shape {tuple(counts.shape)}")
    check_same_device(logits=logits, counts=counts)
    split_val = torch.empty(rows, num_splits, dtype=torch.float32, device=logits.device)
    split_idx = torch.empty(rows, num_splits, dtype=torch.int32, device=logits.device)
    lo, hi = step_key(step_seed)
    _gumbel_sample_kernel[(rows, num_splits)](
        logits, temperature, floor if floor is not None else temperature, greedy, seeded,
        seed_keys, split_val, split_idx, counts, out_val, out_idx, out_stride, out_offset,
        logits.stride(0), vocab, cols_per_split, lo, hi, col_offset,
        HAS_FLOOR=floor is not None, BLOCK=block, MAX_SPLITS=MAX_SPLITS,
        num_warps=max(1, min(config.num_warps, block // 128)),
    )


def choose_num_splits(rows: int, vocab: int, device: torch.device, config: GumbelConfig) -> int:
    """Programs per row: ``programs_per_sm`` per SM, each >= ``min_split_columns`` columns."""
    if device.type != "cuda" or rows == 0:
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(config.programs_per_sm * sms, rows)
    return max(1, min(want, vocab // config.min_split_columns, MAX_SPLITS))


def _check_args(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None,
                greedy: torch.Tensor, seeded: torch.Tensor, seed_keys: torch.Tensor,
                step_seed: int, col_offset: int = 0) -> None:
    """Validate the arguments of :func:`gumbel_best` (raises TypeError / ValueError)."""
    check_dtype("logits", logits, _FLOAT_DTYPES)
    if logits.dim() != 2:
        raise ValueError(f"logits must be (S, V), got shape {tuple(logits.shape)}")
    check_last_dim_contiguous("logits", logits)
    rows = logits.shape[0]
    per_row = {"temperature": (temperature, torch.float32), "greedy": (greedy, torch.bool),
               "seeded": (seeded, torch.bool)}
    if floor is not None:
        per_row["floor"] = (floor, torch.float32)
    for name, (t, dtype) in per_row.items():
        check_dtype(name, t, (dtype,))
        if t.shape != (rows,) or (rows > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous ({rows},), got shape {tuple(t.shape)}")
    check_dtype("seed_keys", seed_keys, (torch.int64,))
    if seed_keys.shape != (rows, 2) or (rows > 0 and not seed_keys.is_contiguous()):
        raise ValueError(f"seed_keys must be a contiguous ({rows}, 2), got shape {tuple(seed_keys.shape)}")
    tensors = {name: t for name, (t, _) in per_row.items()}
    check_same_device(logits=logits, seed_keys=seed_keys, **tensors)
    if isinstance(step_seed, bool) or not isinstance(step_seed, int):
        raise TypeError(f"step_seed must be an int, got {type(step_seed).__name__}")
    if isinstance(col_offset, bool) or not isinstance(col_offset, int):
        raise TypeError(f"col_offset must be an int, got {type(col_offset).__name__}")
    if col_offset < 0 or col_offset + logits.shape[1] > 2 ** 31:
        raise ValueError(f"columns [{col_offset}, {col_offset + logits.shape[1]}) must lie in [0, 2**31)")


# ----------------------------------------------------------------------------- torch reference

def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding [0, 2**32).

    Multipliers are odd and < 2**31, so products stay below 2**63: no int64
    overflow on any device.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def hashed_uniform(keys: torch.Tensor, vocab_size: int, col_offset: int = 0) -> torch.Tensor:
    """Counter-based uniforms: (R, 2) int64 keys -> (R, vocab_size) float32 strictly in (0, 1),
    for the global columns ``col_offset .. col_offset + vocab_size - 1``."""
    cols = torch.arange(col_offset, col_offset + vocab_size, device=keys.device, dtype=torch.int64)
    v = _mix32_torch(cols)                                                               # (V,)
    x = _mix32_torch(v[None, :] ^ keys[:, :1])                                          # (R, V)
    x = _mix32_torch(x ^ keys[:, 1:])
    return ((x >> (32 - _UNIFORM_BITS)).float() + 0.5) / float(1 << _UNIFORM_BITS)


def step_key(step_seed: int) -> tuple[int, int]:
    """The two 31-bit halves of a step seed that key its unseeded rows (low 62 bits count)."""
    return step_seed & _STEP_MASK, (step_seed >> 31) & _STEP_MASK


def row_keys(seeded: torch.Tensor, seed_keys: torch.Tensor, step_seed: int) -> torch.Tensor:
    """(S, 2) int64 keys: ``seed_keys`` on seeded rows, the step's per-row key elsewhere."""
    lo, hi = step_key(step_seed)
    rows = torch.arange(seeded.shape[0], device=seeded.device, dtype=torch.int64)
    k0 = _mix32_torch(rows ^ lo)
    k1 = _mix32_torch(k0 ^ hi)
    return torch.where(seeded[:, None], seed_keys, torch.stack([k0, k1], dim=1))


def gumbel_sample_reference(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None,
                            greedy: torch.Tensor, seeded: torch.Tensor, seed_keys: torch.Tensor,
                            step_seed: int) -> torch.Tensor:
    """:func:`gumbel_sample` in torch ops over a materialised (S, V) noise tensor."""
    return gumbel_best_reference(logits, temperature, floor, greedy, seeded, seed_keys, step_seed)[1]


def gumbel_best_reference(logits: torch.Tensor, temperature: torch.Tensor, floor: torch.Tensor | None,
                          greedy: torch.Tensor, seeded: torch.Tensor, seed_keys: torch.Tensor,
                          step_seed: int, col_offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gumbel_best` in torch ops over a materialised (S, V) noise tensor."""
    raw = logits.float()
    scaled = raw / temperature[:, None]  # (S, V)
    if floor is not None:
        scaled = scaled.masked_fill(raw < floor[:, None], float("-inf"))
    u = hashed_uniform(row_keys(seeded, seed_keys, step_seed), logits.shape[1], col_offset)
    z = torch.where(greedy[:, None], raw, scaled + -torch.log(-torch.log(u)))
    best, idx = z.max(dim=-1)  # the first maximum: the smallest column wins a tie
    return best, idx
