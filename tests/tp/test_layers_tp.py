"""Tensor-parallel layers under a real ``torch.distributed`` group (gloo, CPU).

One spawn of ``world`` processes per world size (2 and 3) runs every check, so the
collectives in the layers' ``forward`` (all-reduce, all-gather) really run. The
parent builds the unsharded (tp_size=1) layers, computes their outputs and sends
weights, inputs and expected outputs to the ranks as numpy arrays; each rank loads
its shard through the weight loaders and compares. A mismatch is recorded and the
rank carries on (the ranks stay in step: every rank runs every collective); an
exception ends the rank and fails every test with its traceback. The parent never
waits without a deadline and leaves no child behind.

Regressions caught here (each was planted and seen to fail):
- row-parallel bias added on every rank (the sum counts it ``world`` times);
- an id equal to a rank's ``vocab_end`` looked up on two ranks (``<=`` for ``<``);
- the LM head's gathered logits keeping the padding of the last shard.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minivllm.executor.distributed import free_port
from minivllm.kernels.reference import add_rms_norm_ref, silu_and_mul_ref
from minivllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minivllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minivllm.ops import communicator as ar
from minivllm.ops.communicator import Communicator
from minivllm.ops.dispatch import Ops

WORLDS = (2, 3)
HIDDEN, D = 12, 4
SPAWN_TIMEOUT_S = 120.0
# Heads per world: divisible query heads; KV heads fewer than ranks (replicated) and not.
QKV_HEADS = {2: [(4, 1), (4, 2), (8, 4)], 3: [(6, 1), (6, 3)]}
# Vocab per world: divisible; not (last shard padded: 11 -> 6 + 5, 10 -> 4 + 4 + 2); and
# smaller than the shards need (4 -> 2 + 2 + 0: the last rank holds only padding).
VOCABS = {2: [12, 11], 3: [12, 10, 4]}
Case = dict[str, np.ndarray]


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a)


def n(x: torch.Tensor) -> np.ndarray:
    return x.detach().numpy().copy()


# ---- the unsharded references (parent) -----------------------------------------------------

def row_case(gen: torch.Generator, in_size: int, out_size: int) -> Case:
    w, b = torch.randn(out_size, in_size, generator=gen), torch.randn(out_size, generator=gen)
    x = torch.randn(5, in_size, generator=gen)
    full = RowParallelLinear(in_size, out_size, bias=True)
    full.weight.weight_loader(full.weight, w)
    full.bias.weight_loader(full.bias, b)
    return {"w": n(w), "b": n(b), "x": n(x), "want": n(full(x))}


def norm_case(gen: torch.Generator, in_size: int, out_size: int) -> Case:
    """A row-parallel layer with bias, then the residual add + RMSNorm after it."""
    c = row_case(gen, in_size, out_size)
    residual, weight = torch.randn(5, out_size, generator=gen), torch.rand(out_size, generator=gen) + 0.5
    want, want_res = add_rms_norm_ref(t(c["want"]), residual, weight, 1e-6)
    return {**c, "residual": n(residual), "norm_w": n(weight), "want_norm": n(want), "want_res": n(want_res)}


def mlp_case(gen: torch.Generator, inter: int) -> Case:
    gate, up = torch.randn(inter, HIDDEN, generator=gen), torch.randn(inter, HIDDEN, generator=gen)
    down, x = torch.randn(HIDDEN, inter, generator=gen), torch.randn(5, HIDDEN, generator=gen)
    gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter])
    gate_up.weight.weight_loader(gate_up.weight, gate, 0)
    gate_up.weight.weight_loader(gate_up.weight, up, 1)
    down_proj = RowParallelLinear(inter, HIDDEN)
    down_proj.weight.weight_loader(down_proj.weight, down)
    g, u = gate_up(x).chunk(2, dim=-1)
    return {"gate": n(gate), "up": n(up), "down": n(down), "x": n(x),
            "want": n(down_proj(torch.nn.functional.silu(g) * u))}


def gqa_mix(qkv: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """A stand-in for attention that pairs each query head with its KV head, as GQA does:
    (T, (H + 2 Hkv) D) -> (T, H D) with ``o_h = q_h * k_g + v_g``, ``g = h // (H / Hkv)``."""
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    group = heads // kv_heads
    k = k.reshape(-1, kv_heads, D).repeat_interleave(group, dim=1)
    v = v.reshape(-1, kv_heads, D).repeat_interleave(group, dim=1)
    return (q.reshape(-1, heads, D) * k + v).reshape(-1, heads * D)


def attention_case(gen: torch.Generator, heads: int, kv_heads: int) -> Case:
    """With a q/k/v bias (Qwen2's), sharded by heads like the weights."""
    parts = {s: torch.randn(h * D, HIDDEN, generator=gen)
             for s, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    biases = {s: torch.randn(w.shape[0], generator=gen) for s, w in parts.items()}
    o, o_b = torch.randn(HIDDEN, heads * D, generator=gen), torch.randn(HIDDEN, generator=gen)
    x = torch.randn(5, HIDDEN, generator=gen)
    qkv = QKVParallelLinear(HIDDEN, D, heads, kv_heads, bias=True)
    for s, w in parts.items():
        qkv.weight.weight_loader(qkv.weight, w, s)
        qkv.bias.weight_loader(qkv.bias, biases[s], s)
    o_proj = RowParallelLinear(heads * D, HIDDEN, bias=True)
    o_proj.weight.weight_loader(o_proj.weight, o)
    o_proj.bias.weight_loader(o_proj.bias, o_b)
    want = o_proj(gqa_mix(qkv(x), heads, kv_heads))
    return {**{s: n(w) for s, w in parts.items()}, **{f"{s}_b": n(b) for s, b in biases.items()},
            "o": n(o), "o_b": n(o_b), "x": n(x),
            "heads": np.array(heads), "kv_heads": np.array(kv_heads), "want": n(want)}


def vocab_case(gen: torch.Generator, vocab: int, world: int) -> Case:
    w, h = torch.randn(vocab, HIDDEN, generator=gen), torch.randn(4, HIDDEN, generator=gen)
    head = ParallelLMHead(vocab, HIDDEN)
    head.weight.weight_loader(head.weight, w)
    # Every id, then each rank's first and last id and its vocab_end (the next rank's first).
    shard = -(-vocab // world)
    edges = [i for r in range(world) for i in (r * shard - 1, r * shard, (r + 1) * shard) if 0 <= i < vocab]
    ids = torch.tensor(list(range(vocab)) + edges + edges[::-1])
    return {"w": n(w), "ids": n(ids), "hidden": n(h), "want_emb": n(w[ids]), "want_logits": n(head(h))}


def make_cases(world: int) -> dict[str, list[Case]]:
    gen = torch.Generator().manual_seed(world)
    return {
        "row_partials": [row_case(gen, 6 * world, 5)],
        "add_rms_norm": [norm_case(gen, 6 * world, 8)],
        "fused_dispatch": [norm_case(gen, 6 * world, 8)],
        "mlp": [mlp_case(gen, 4 * world)],
        "attention_gqa": [attention_case(gen, h, kv) for h, kv in QKV_HEADS[world]],
        "vocab": [vocab_case(gen, v, world) for v in VOCABS[world]],
    }


# ---- the checks (each rank) ----------------------------------------------------------------

Fail = Callable[[str], None]


def expect_close(fail: Fail, what: str, got: torch.Tensor, want: np.ndarray) -> None:
    if tuple(got.shape) != want.shape:
        fail(f"{what}: shape {tuple(got.shape)}, want {want.shape}")
    elif not torch.allclose(got, t(want), rtol=1e-5, atol=1e-5):
        fail(f"{what}: max |diff| {(got - t(want)).abs().max().item():.3g}")


def comm_of(rank: int, world: int, symm: object = None) -> Communicator:
    return Communicator(rank, world, symm)  # type: ignore[arg-type]


def loaded_row(c: Case, rank: int, world: int) -> RowParallelLinear:
    in_size, out_size = c["w"].shape[1], c["w"].shape[0]
    layer = RowParallelLinear(in_size, out_size, bias=True, tp_rank=rank, tp_size=world)
    layer.weight.weight_loader(layer.weight, t(c["w"]))
    layer.bias.weight_loader(layer.bias, t(c["b"]))
    return layer


def check_row_partials(rank: int, world: int, c: Case, fail: Fail) -> None:
    """The ranks' partial sums, summed by the communicator, equal the unsharded layer's output
    on every rank (the bias counted once: only rank 0 adds it)."""
    layer = loaded_row(c, rank, world)
    x = t(c["x"]).chunk(world, dim=-1)[rank].contiguous()
    expect_close(fail, "summed partials", comm_of(rank, world).all_reduce(layer(x)), c["want"])


def check_add_rms_norm(rank: int, world: int, c: Case, fail: Fail) -> None:
    """``Ops.add_rms_norm`` of a row-parallel layer's partial sums: sum over ranks, residual
    add, RMSNorm, as the unsharded layer and norm give."""
    ops = Ops(triton=False, use_gemv=False, pdl=False, comm=comm_of(rank, world))
    layer = loaded_row(c, rank, world)
    x = t(c["x"]).chunk(world, dim=-1)[rank].contiguous()
    h, res = ops.add_rms_norm(layer(x), t(c["residual"]), t(c["norm_w"]), 1e-6)
    expect_close(fail, "normed", h, c["want_norm"])
    expect_close(fail, "residual", res, c["want_res"])


def check_mlp(rank: int, world: int, c: Case, fail: Fail) -> None:
    """Merged gate/up (column) -> silu*up -> down (row, all-reduced) equals the unsharded MLP."""
    inter = c["gate"].shape[0]
    gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter], tp_rank=rank, tp_size=world)
    gate_up.weight.weight_loader(gate_up.weight, t(c["gate"]), 0)
    gate_up.weight.weight_loader(gate_up.weight, t(c["up"]), 1)
    down = RowParallelLinear(inter, HIDDEN, tp_rank=rank, tp_size=world)
    down.weight.weight_loader(down.weight, t(c["down"]))
    g, u = gate_up(t(c["x"])).chunk(2, dim=-1)
    partial = down(silu_and_mul_ref(torch.cat([g, u], dim=-1)))
    expect_close(fail, "mlp", comm_of(rank, world).all_reduce(partial), c["want"])


def check_attention_gqa(rank: int, world: int, c: Case, fail: Fail) -> None:
    """QKV with bias (column, KV heads split or replicated) -> per-head GQA pairing -> o_proj
    (row): each rank's query heads meet their own KV head and its bias."""
    heads, kv_heads = int(c["heads"]), int(c["kv_heads"])
    qkv = QKVParallelLinear(HIDDEN, D, heads, kv_heads, bias=True, tp_rank=rank, tp_size=world)
    for s in "qkv":
        qkv.weight.weight_loader(qkv.weight, t(c[s]), s)
        qkv.bias.weight_loader(qkv.bias, t(c[f"{s}_b"]), s)
    o_proj = RowParallelLinear(heads * D, HIDDEN, bias=True, tp_rank=rank, tp_size=world)
    o_proj.weight.weight_loader(o_proj.weight, t(c["o"]))
    o_proj.bias.weight_loader(o_proj.bias, t(c["o_b"]))
    o = gqa_mix(qkv(t(c["x"])), qkv.num_heads, qkv.num_kv_heads)
    expect_close(fail, f"attention heads={heads} kv_heads={kv_heads}", comm_of(rank, world).all_reduce(o_proj(o)),
                 c["want"])


def check_vocab(rank: int, world: int, c: Case, fail: Fail) -> None:
    """Every id (each rank's ``vocab_end`` included) embedded once; gathered logits unpadded."""
    vocab = c["w"].shape[0]
    emb = VocabParallelEmbedding(vocab, HIDDEN, tp_rank=rank, tp_size=world)
    head = ParallelLMHead(vocab, HIDDEN, tp_rank=rank, tp_size=world)
    emb.weight.weight_loader(emb.weight, t(c["w"]))
    head.weight.weight_loader(head.weight, t(c["w"]))
    comm = comm_of(rank, world)
    ops = Ops(triton=False, use_gemv=False, pdl=False, comm=comm)
    got = ops.embed(t(c["ids"]), emb.weight, emb.vocab_start, emb.vocab_end)
    expect_close(fail, f"embedding vocab={vocab}", got, c["want_emb"])
    expect_close(fail, f"lm head vocab={vocab}", head(t(c["hidden"]), comm), c["want_logits"])
    # Ungathered: exactly this rank's columns of the logits, padding dropped.
    want_shard = c["want_logits"][:, head.vocab_start:head.vocab_end]
    expect_close(fail, f"lm head shard vocab={vocab}", head(t(c["hidden"]), comm, gather=False), want_shard)


class StubSymm:
    """Stands in for the symmetric-memory paths (CUDA only): the same sums through gloo,
    each kind of call counted. Takes and fuses (T, N) tensors of at most ``limit`` elements;
    its fused buffer is one tensor whose view ``partial_slot`` hands out."""

    def __init__(self, limit: int, numel: int = 64) -> None:
        self.limit, self.calls, self.norm_calls, self.in_place = limit, 0, 0, 0
        self.half, self.numel = 0, numel
        self.buffers: dict[torch.dtype, torch.Tensor] = {}

    def takes(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.limit

    def fuses(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return len(shape) == 2 and shape[0] * shape[1] <= self.limit

    def partial_slot(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        if not self.fuses(shape, dtype):
            return None
        buffer = self.buffers.setdefault(dtype, torch.full((self.numel,), float("nan"), dtype=dtype))
        return buffer[:shape[0] * shape[1]].view(shape)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = x.clone()
        if dist.is_initialized():
            dist.all_reduce(out)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
        self.norm_calls += 1
        self.in_place += x.dtype in self.buffers and x.data_ptr() == self.buffers[x.dtype].data_ptr()
        total = x.clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        return add_rms_norm_ref(total, residual, weight, eps)


def check_fused_dispatch(rank: int, world: int, c: Case, fail: Fail) -> None:
    """Where the fused path takes the partial sums, ``Ops.add_rms_norm`` sends them there (and
    the layer's output written into ``partial_out`` is not copied); where it does not, the
    plain all-reduce of ``torch.distributed``, then the norm: the same result either way."""
    layer = loaded_row(c, rank, world)
    x = t(c["x"]).chunk(world, dim=-1)[rank].contiguous()
    for limit, fused in ((10 ** 6, True), (1, False)):
        stub = StubSymm(limit)
        ops = Ops(triton=False, use_gemv=False, pdl=False, comm=comm_of(rank, world, stub))
        out = ops.partial_out(x, layer.weight)
        if (out is not None) != fused:
            fail(f"fused {fused}: partial_out gave {'a slot' if out is not None else 'none'}")
        partial = ops.linear(x, layer.weight, layer.partial_bias, out=out)
        h, res = ops.add_rms_norm(partial, t(c["residual"]), t(c["norm_w"]), 1e-6)
        expect_close(fail, f"fused {fused}: normed", h, c["want_norm"])
        expect_close(fail, f"fused {fused}: residual", res, c["want_res"])
        want_calls = (0, 1, 1) if fused else (0, 0, 0)  # not fused: torch.distributed's all-reduce
        if (stub.calls, stub.norm_calls, stub.in_place) != want_calls:
            fail(f"fused {fused}: (plain, fused, in place) calls {(stub.calls, stub.norm_calls, stub.in_place)}, "
                 f"want {want_calls}")


CHECKS: dict[str, Callable[[int, int, Case, Fail], None]] = {
    "row_partials": check_row_partials,
    "add_rms_norm": check_add_rms_norm,
    "fused_dispatch": check_fused_dispatch,
    "mlp": check_mlp,
    "attention_gqa": check_attention_gqa,
    "vocab": check_vocab,
}


def run_rank(rank: int, world: int, port: int, cases: dict[str, list[Case]], results: Any) -> None:
    """Child process: join the gloo group, run every check, put ``(rank, failures, error)``."""
    failures: dict[str, list[str]] = {name: [] for name in CHECKS}
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
        for name, check in CHECKS.items():
            for c in cases[name]:
                check(rank, world, c, lambda msg, name=name: failures[name].append(f"rank {rank}: {msg}"))
        dist.destroy_process_group()
        results.put((rank, failures, None))
    except BaseException:  # noqa: BLE001 - any error must reach the parent, then the rank ends
        results.put((rank, failures, f"rank {rank} raised:\n{traceback.format_exc()}"))


def spawn_world(world: int) -> dict[str, list[str]]:
    """Run every check on ``world`` gloo ranks; per check, the failures of all ranks.

    Raises:
        AssertionError: a rank raised, died or did not finish in time (with its message).
    """
    cases = make_cases(world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, world, port, cases, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[dict[str, list[str]], str | None]] = {}
    error = None
    try:
        error = collect(procs, results, reports)
    finally:
        for p in procs:
            p.join(timeout=10 if error is None else 0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert error is None, error
    return {name: [f for r in range(world) for f in reports[r][0][name]] for name in CHECKS}


def collect(procs: list[Any], results: Any, reports: dict) -> str | None:
    """Wait (with a deadline) for every rank's report; the first error ends the wait."""
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while len(reports) < len(procs):
        try:
            rank, failures, error = results.get(timeout=0.5)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in reports and not p.is_alive()]
            if dead:
                return f"rank(s) {dead} exited (codes {[procs[r].exitcode for r in dead]}) without a report"
            if time.monotonic() > deadline:
                return f"ranks {sorted(set(range(len(procs))) - set(reports))} timed out"
            continue
        reports[rank] = (failures, error)
        if error is not None:
            return error
    return None


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"tp{w}")
def test_tp_layers_match_unsharded(world: int) -> None:
    """Every check of ``CHECKS`` on ``world`` ranks (one spawn: a test of its own per check
    would spawn the world again on each test worker that runs one), then no child left."""
    failures = spawn_world(world)
    failed = {name: f for name, f in failures.items() if f}
    assert not failed, "\n".join(f"tp={world} {name}:\n" + "\n".join(f) for name, f in failed.items())
    assert not mp.active_children()


def test_two_shot_rule_large_messages_whose_shares_align() -> None:
    """The symmetric-memory path sends a plain sum to the two-shot kernel from
    ``TWO_SHOT_MIN_BYTES`` up when each rank's share is whole 16-byte vectors; the rest to
    the one-shot kernel. The kernels themselves run only on GPUs (tests_gpu/test_tp_gpu.py)."""
    big = ar.TWO_SHOT_MIN_BYTES
    assert ar.uses_two_shot(big, 2)
    assert not ar.uses_two_shot(big - 16, 2)  # 16 bytes under the minimum
    assert not ar.uses_two_shot(big + 16, 2)  # half a vector per rank
    assert not ar.uses_two_shot(big + 16, 4)
    assert ar.uses_two_shot(big + 64, 4)


def test_decoder_leaves_every_row_parallel_sum_to_the_norm_after_it() -> None:
    """Model level, in one process: with a stand-in for the fused path in the model's ops,
    every layer's ``o_proj`` and ``down_proj`` partial sums go through the norm after them
    (two per layer and forward: the last layer's to the final norm), written in place, and
    the one plain all-reduce per forward is the embedding's; greedy tokens are those without
    it, on the layer-by-layer and on the small-batch forward (one rank: the stand-in's "sum"
    is the rank's own partial; the gloo checks above cover two and three ranks)."""
    from pathlib import Path

    from minivllm import LLM, SamplingParams

    fixture = str(Path(__file__).resolve().parents[2] / "fixtures" / "tiny-qwen3")
    # A prefill and two decode steps (the second reads what the first wrote): every kind of
    # forward; the counts below are per forward, so more tokens would only repeat them.
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    for dtype in ("float32", "bfloat16"):  # bfloat16: the GEMV kernel's small-batch forward
        with LLM(fixture, device="cpu", kernels="triton", dtype=dtype, skip_tokenizer_init=True,
                 num_blocks=32, max_model_len=64, block_size=4) as llm:
            want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            model = llm.engine.executor.model
            stub = StubSymm(10 ** 9, numel=1 << 16)
            plain = model.ops
            swap = lambda ops: [setattr(m, "ops", ops) for m in model.modules() if hasattr(m, "ops")]  # noqa: E731
            swap(Ops(triton=plain.triton, use_gemv=plain.use_gemv, pdl=False, comm=Communicator(0, 1, stub)))
            try:
                got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            finally:
                swap(plain)
            layers = len(model.model.layers)
            forwards = stub.calls
        assert got == want, dtype
        assert forwards > 0 and stub.norm_calls == 2 * layers * forwards, (dtype, stub.norm_calls, forwards)
        assert stub.in_place == stub.norm_calls, dtype
