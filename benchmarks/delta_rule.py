"""The gated delta rule's kernels alone, at Qwen3.5's DeltaNet shapes (16 q/k heads and 32
value heads of 128; ``--heads`` for a TP rank's share), beside flash-linear-attention's
(``fla-core``) where it is installed.

    PYTHONPATH=. python3 -m benchmarks.delta_rule [--prefill 1x2048,8x512,64x64]
        [--decode 1,16,64,256] [--impls ours-chunked,ours-recurrent,fla] [--sweep] [--smoke]

- prefill: B sequences of L fresh tokens each (varlen rows, one start state per sequence
  read from its slot, the final state written back), bf16 q/k/v, float32 state. tok/s of
  the layer's rule alone, each implementation timed on the same inputs. Ours: the chunked
  kernel (``kernels/gated_delta_rule_chunked.py``) where it exists, and the token-by-token
  one (``kernels/gated_delta_rule_recurrent.py``). fla: ``chunk_gated_delta_rule`` with
  ``cu_seqlens``, its initial states gathered from the slots and its final states
  scattered back (the copies an engine would need, timed with it), q/k normalised in its
  kernel (``use_qk_l2norm_in_kernel``).
- decode: B sequences, one token each, in a CUDA graph. The bytes a step must move are the
  B states read and written (H K V float32 each, twice) plus q, k, v, g, beta and the
  output; GB/s against the copy bandwidth measured in the run (``benchmarks.gpu_timing``).
  fla: ``fused_recurrent_gated_delta_rule`` over dense (B, H, K, V) states (its
  ``initial_state`` read and ``final_state`` written: the same bytes, no slot gather).

``--sweep``: the chunked kernel also at each (chunk, value tile, warps) of ``SWEEP``, the
recurrent one in decode at each (value tile, warps) of ``DECODE_SWEEP``.

Every implementation is first checked against the torch reference on the first problem
(``kernels/linear_attention_reference.py``); one that disagrees is reported, not timed.
Summary: ``$OUT/delta_rule.json``. ``--smoke``: tiny shapes on the CPU, the Triton kernels
under the interpreter, nothing timed (every code path once).
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any, Callable

import torch

from benchmarks.report import write_summary
from minivllm.kernels.linear_attention_reference import gated_delta_rule_recurrent_reference

IMPLS = ("ours-chunked", "ours-recurrent", "fla")


def _problem(lens: list[int], hk: int, h: int, dim: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    q, k = (rand(t, hk, dim).to(torch.bfloat16) for _ in range(2))
    v = rand(t, h, dim).to(torch.bfloat16)
    g = -(torch.rand(t, h, generator=gen) * 0.5).to(device)   # log decay <= 0
    beta = torch.rand(t, h, generator=gen).to(device=device, dtype=torch.bfloat16)
    nseq = len(lens)
    state = torch.randn(nseq * 2, h, dim, dim, generator=gen).mul_(0.1).to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64, device=device)
    slots = torch.arange(nseq, 2 * nseq, dtype=torch.int64, device=device)  # not 0..B-1: a real gather
    init = torch.ones(nseq, dtype=torch.bool, device=device)
    return dict(q=q, k=k, v=v, g=g, beta=beta, state=state, cu=cu, slots=slots, init=init)


def _ours(kind: str) -> Callable[[dict[str, torch.Tensor]], torch.Tensor] | None:
    """``ours-recurrent``, ``ours-chunked`` (its defaults) or ``ours-chunked-C-BV-W`` (chunk C,
    value tile BV, W warps: the sweep's names)."""
    tiles: dict[str, int] = {}
    if kind.startswith("ours-recurrent"):
        from minivllm.kernels.gated_delta_rule_recurrent import gated_delta_rule_recurrent as fn
        if kind != "ours-recurrent":
            block_v, warps = (int(x) for x in kind.split("-")[2:])
            tiles = dict(block_v=block_v, num_warps=warps)
    else:
        from minivllm.kernels.gated_delta_rule_chunked import gated_delta_rule_chunked as fn
        if kind != "ours-chunked":
            chunk, block_v, warps = (int(x) for x in kind.split("-")[2:])
            tiles = dict(chunk=chunk, block_v=block_v, num_warps=warps)

    def run(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return fn(p["q"], p["k"], p["v"], p["g"], p["beta"], p["state"], p["cu"], p["slots"], p["init"],
                  **tiles)  # type: ignore[operator]
    return run


SWEEP = [f"ours-chunked-{c}-{bv}-{w}" for c in (16, 32) for bv in (32, 64) for w in (4, 8)]  # 64: no compile
DECODE_SWEEP = [f"ours-recurrent-{bv}-{w}" for bv in (16, 32, 64) for w in (1, 2, 4)]


def _fla(decode: bool) -> Callable[[dict[str, torch.Tensor]], torch.Tensor] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None

    def run(p: dict[str, torch.Tensor]) -> torch.Tensor:
        h0 = p["state"][p["slots"]]
        q, k, v, g, beta = (p[name][None] for name in ("q", "k", "v", "g", "beta"))
        if decode:  # one token per sequence: B batch rows of length 1, no cu_seqlens
            q, k, v, g, beta = (x[0][:, None] for x in (q, k, v, g, beta))
            # g and beta by name: the recurrent entry point takes gk and gv between them
            o, ht = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, scale=p["q"].shape[-1] ** -0.5,
                                                     initial_state=h0, output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True)
            o = o[:, 0]
        else:
            o, ht = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, scale=p["q"].shape[-1] ** -0.5,
                                           initial_state=h0, output_final_state=True, cu_seqlens=p["cu"],
                                           use_qk_l2norm_in_kernel=True)
            o = o[0]
        p["state"][p["slots"]] = ht.float()
        return o
    return run


def _impls(names: list[str], decode: bool) -> dict[str, Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    found = {}
    for name in names:
        fn = _fla(decode) if name == "fla" else _ours(name)
        if fn is None:
            print(f"{name}: not available here, skipped")
        else:
            found[name] = fn
    return found


def _check(impls: dict[str, Callable], p: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each implementation's max error against the reference, output and final state."""
    want_state = p["state"].clone()
    want = gated_delta_rule_recurrent_reference(p["q"], p["k"], p["v"], p["g"], p["beta"], want_state, p["cu"],
                                                p["slots"], p["init"])
    verdicts = {}
    for name, fn in impls.items():
        mine = dict(p, state=p["state"].clone())
        try:
            got = fn(mine)
        except Exception as e:  # an implementation that cannot run these shapes is reported
            verdicts[name] = f"failed: {type(e).__name__}: {e}"[:300]
            continue
        out_err = (got.float() - want.float()).abs().max().item()
        state_err = (mine["state"] - want_state).abs().max().item()
        ok = out_err < 5e-2 and state_err < 5e-2
        verdicts[name] = f"{'ok' if ok else 'WRONG'} out {out_err:.2e} state {state_err:.2e}"
    return verdicts


def _cuda_ms(fn: Callable[[], Any], iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", default="1x2048,8x512,64x64", help="BxL problems, comma list")
    ap.add_argument("--decode", default="1,16,64,256", help="batch sizes, comma list")
    ap.add_argument("--heads", default="16,32", help="q/k heads, value heads")
    ap.add_argument("--dim", type=int, default=128, help="head dim of q/k and of v")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--sweep", action="store_true", help="also each tiling of SWEEP (prefill), DECODE_SWEEP (decode)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    names = args.impls.split(",")
    hk, h = (int(x) for x in args.heads.split(","))
    dim, device = args.dim, "cuda"
    prefill = [tuple(int(x) for x in s.split("x")) for s in args.prefill.split(",") if s]
    decode = [int(x) for x in args.decode.split(",") if x]
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        hk, h, dim, device, prefill, decode = 1, 2, 16, "cpu", [(2, 19)], [3]
    summary: dict[str, Any] = {"heads": [hk, h], "dim": dim, "prefill": [], "decode": []}
    if device == "cuda":
        from benchmarks.gpu_timing import copy_bandwidth_gbs, graph_us
        summary["copy_gbs"] = copy_gbs = copy_bandwidth_gbs()
        print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    for phase, problems in (("prefill", prefill), ("decode", [(b, 1) for b in decode])):
        sweep = (SWEEP if phase == "prefill" else DECODE_SWEEP) if args.sweep else []
        impls = _impls(names + sweep, phase == "decode")
        for i, (b, length) in enumerate(problems):
            p = _problem([length] * b, hk, h, dim, device, seed=i)
            row: dict[str, Any] = {"batch": b, "tokens": length, "check": _check(impls, p)}
            print(f"{phase} {b}x{length}: {row['check']}")
            if device == "cuda":
                for name, fn in impls.items():
                    if not row["check"][name].startswith("ok"):
                        continue
                    if phase == "prefill":
                        ms = _cuda_ms(lambda: fn(p))
                        row[name] = {"ms": ms, "tok_s": b * length / ms * 1e3}
                    else:
                        us = graph_us(lambda _: fn(p), 1)
                        moved = b * h * dim * dim * 4 * 2 + sum(p[x][:b].numel() * p[x].element_size()
                                                                 for x in ("q", "k", "v", "g", "beta")) \
                            + b * h * dim * 2
                        row[name] = {"us": us, "gbs": moved / us / 1e3, "of_copy": moved / us / 1e3 / copy_gbs}
                    print(f"  {name}: {row[name]}")
            summary[phase].append(row)
    write_summary("delta_rule", summary)


if __name__ == "__main__":
    main()
