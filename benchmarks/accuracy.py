"""bf16 against float32 on the same weights, minivllm beside HF transformers (greedy tokens
kept identical, teacher-forced flips; ``tests_gpu/test_bf16_accuracy.py`` asserts on them).

    PYTHONPATH=. python3 -m benchmarks.accuracy [--prompts 16] [--prompt-len 32] [--steps 64]
        [--std 0.1] [--smoke]

Model: Qwen3-0.6B shapes, random weights N(0, std) with norm weights 1 + 0.2 N(0, 1),
rounded to bf16 and saved in float32, so both dtypes of both engines run the same weights.
Prompts: random ids, all of one length (HF then batches them without padding).

- teacher-forced: each side's bf16 logits against its own float32 logits on one context
  (our float32 greedy continuation), over every (prompt, step): how often the argmax
  differs ("flip"), how often it falls outside float32's top-5, the logits' relative
  error. Ours through the executor the engine builds (CUDA graphs where it has them),
  HF one prompt at a time.
- greedy: ``LLM.generate`` against HF's argmax loop (:func:`hf_greedy`; both take an
  end-of-sequence token like any other), per prompt the tokens identical to float32 before
  the first difference, and whether that first bf16 token is in float32's
  top-5 (HF's float32 model on the shared context; a prompt without a difference counts).

With ``$OUT`` set, ``$OUT/accuracy.json``. ``--smoke``: a tiny model on the CPU.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
from typing import Any

import numpy as np
import torch

from benchmarks.qwen3_shapes import QWEN3_0_6B, SMOKE_SHAPES
from benchmarks.report import write_summary

BLOCK_SIZE = 16


# ---- model, prompts, greedy runs -------------------------------------------------------

def make_bf16_checkpoint(path: str, std: float = 0.1, seed: int = 0, device: str = "cuda",
                         **overrides: Any):
    """Save a random Qwen3 (0.6B shapes unless overridden) whose weights are bf16 values
    stored in float32; return the float32 HF model (eval, on ``device``). No bos/eos: a
    greedy run always produces the tokens asked for."""
    import transformers

    from tests.model_utils import randomize_weights

    cfg = transformers.Qwen3Config(**{**QWEN3_0_6B, **overrides, "bos_token_id": None, "eos_token_id": None})
    cfg.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    randomize_weights(hf, std)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.save_pretrained(path)
    return hf


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` random ids (one length: HF batches them unpadded)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, length).tolist() for _ in range(num)]


def leading_identical(ref: list[int], got: list[int]) -> int:
    """Tokens ``got`` shares with ``ref`` before the first difference."""
    n = 0
    for a, b in zip(ref, got):
        if a != b:
            break
        n += 1
    return n


@torch.no_grad()
def top5_at_first_difference(hf32, prompts: list[list[int]], ref: list[list[int]],
                             got: list[list[int]]) -> list[bool]:
    """Per prompt: is ``got``'s first differing token in float32's top-5 on that context
    (True where nothing differs)? ``hf32`` is the float32 reference model."""
    device = next(hf32.parameters()).device
    hits = []
    for p, r, g in zip(prompts, ref, got):
        k = leading_identical(r, g)
        if k == min(len(r), len(g)):
            hits.append(True)
            continue
        logits = hf32(torch.tensor([p + r[:k]], device=device)).logits[0, -1]
        hits.append(g[k] in logits.topk(5).indices.tolist())
    return hits


def length_groups(prompts: list[list[int]], batched: bool = True) -> list[list[int]]:
    """The prompts' indices grouped by prompt length, in order of first appearance: each
    group batches without padding (``batched=False``: one prompt a group)."""
    if not batched:
        return [[i] for i in range(len(prompts))]
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    return list(groups.values())


def hf_greedy(hf, prompts: list[list[int]], n: int, batched: bool = False) -> list[list[int]]:
    """HF's plain greedy decode: the argmax of each step's logits, ``n`` tokens, an
    end-of-sequence token taken like any other (as our engine with ``ignore_eos``; no logits
    processors: ``generate``'s ``min_new_tokens`` would forbid EOS instead). One prompt at a
    time, or (``batched``) the prompts of each length at once (:func:`length_groups`)."""
    groups = length_groups(prompts, batched)
    out: list[list[int]] = [[] for _ in prompts]
    for group in groups:
        _, fed = _hf_decode(hf, [prompts[i] for i in group], n, None)
        for i, row in zip(group, fed.tolist()):
            out[i] = row
    return out


@torch.no_grad()
def _hf_decode(hf, prompts: list[list[int]], steps: int, cont: torch.Tensor | None,
               keep_logits: bool = False) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Prompts of one length, then ``steps`` tokens over a DynamicCache: ``cont`` (B, steps)
    fed, or each step's argmax when None. Returns the float32 logits (steps + 1, B, V) when
    ``keep_logits`` (else None) and the fed tokens (B, steps)."""
    device = next(hf.parameters()).device
    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    cache, x = _new_cache(hf), torch.tensor(prompts, device=device)
    logits, fed = [], []
    for s in range(steps + 1):
        last = hf(input_ids=x, use_cache=True, **{kw: cache}).logits[:, -1].float()
        if keep_logits:
            logits.append(last)
        if s == steps:
            break
        x = (cont[:, s].to(device) if cont is not None else last.argmax(-1))[:, None]
        fed.append(x)
    out = torch.cat(fed, dim=1) if fed else torch.zeros(len(prompts), 0, dtype=torch.long, device=device)
    return (torch.stack(logits) if keep_logits else None), out


def make_llm(path: str, dtype: str, prompts: list[list[int]], n: int, device: str = "cuda",
             max_num_seqs: int | None = None):
    """Our engine as users run it on ``device`` (CUDA graphs, Triton, async scheduling on
    CUDA), with a pool just big enough (sizing from free memory would starve HF);
    ``max_num_seqs`` (None: every prompt at once) bounds a step's batch."""
    from minivllm import LLM

    max_len = max(map(len, prompts)) + n + BLOCK_SIZE
    return LLM(path, device=device, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=max_num_seqs or len(prompts),
               max_model_len=max_len, max_num_batched_tokens=max(2048, sum(map(len, prompts))),
               num_blocks=len(prompts) * (-(-max_len // BLOCK_SIZE)) + 8, block_size=BLOCK_SIZE,
               enable_prefix_caching=False)


def engine_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy completions of ``n`` tokens through ``LLM.generate``, an end-of-sequence token
    taken like any other (as :func:`hf_greedy`)."""
    from minivllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def release_memory() -> None:
    """Collect dropped models and return their memory to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- teacher-forced runs ---------------------------------------------------------------

@torch.no_grad()
def ours_teacher_forced(ex, prompts: list[list[int]], steps: int,
                        cont: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``prompts`` in one step, then ``steps`` batched decode steps through the
    executor ``ex`` (graphs replay where it has them), feeding ``cont`` (B, steps), or its
    own greedy tokens when None. Returns float32 logits (steps + 1, B, V) and the fed (B, steps)."""
    from minivllm.engine.plan import StepPlan
    from minivllm.sampling import SamplingParams

    b, bs = len(prompts), ex.block_size
    width = -(-(max(map(len, prompts)) + steps) // bs)
    tables = [tuple(range(i * width, (i + 1) * width)) for i in range(b)]
    greedy = [SamplingParams(temperature=0)] * b
    chunks, starts, logits, fed = prompts, [0] * b, [], []
    for s in range(steps + 1):
        plan = StepPlan.build(list(range(b)), chunks, starts, tables, [True] * b, greedy, bs)
        logits.append(ex.compute_logits(plan).float())
        if s == steps:
            break
        nxt = (cont[:, s] if cont is not None else logits[-1].argmax(-1)).tolist()
        fed.append(nxt)
        chunks, starts = [[t] for t in nxt], [len(p) + s for p in prompts]
    return torch.stack(logits), torch.tensor(fed, dtype=torch.long).T


def _new_cache(hf: torch.nn.Module) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=hf.config)
    except TypeError:  # transformers 4.x
        return DynamicCache()


def hf_teacher_forced(hf, prompts: list[list[int]], cont: torch.Tensor, batched: bool = True) -> torch.Tensor:
    """HF's float32 logits (steps + 1, B, V) of the prompts and then each fed token of
    ``cont`` (B, steps), decoding over a DynamicCache: the prompts of each length at once
    (:func:`length_groups`); ``batched=False``: one prompt at a time."""
    groups = length_groups(prompts, batched)
    out = None
    for g in groups:
        part, _ = _hf_decode(hf, [prompts[i] for i in g], cont.shape[1], cont[g], keep_logits=True)
        if out is None:
            out = torch.empty(cont.shape[1] + 1, len(prompts), part.shape[-1], device=part.device)
        out[:, g] = part
    return out


def token_stats(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Over all (step, prompt): argmax flips vs ``ref``, argmax outside ref's top-5, mean
    relative error of the logits rows."""
    got, want = logits.argmax(-1), ref.argmax(-1)
    outside = ~(ref.topk(5, dim=-1).indices == got[..., None]).any(-1)
    rows = (logits - ref).flatten(0, 1).norm(dim=-1) / ref.flatten(0, 1).norm(dim=-1)
    return {"flip": (got != want).float().mean().item(), "outside_top5": outside.float().mean().item(),
            "logits_rel": rows.mean().item()}


def teacher_forced_against_reference(ref_logits: torch.Tensor, hf16, ex, prompts: list[list[int]],
                                     cont: torch.Tensor) -> dict[str, dict[str, float]]:
    """HF's bf16 model ``hf16`` and our executor ``ex`` over one teacher-forced context
    (``cont`` (B, steps), the reference's greedy tokens), each side's logits against the
    one reference ``ref_logits`` (steps + 1, B, V) (:func:`hf_teacher_forced` of the
    float32 model on the same weights), as :func:`token_stats`. Unlike
    :func:`teacher_forced_flips` both sides meet the same reference, so weights that are
    not 16-bit to begin with (a GGUF file's) count the same for both."""
    theirs = token_stats(hf_teacher_forced(hf16, prompts, cont), ref_logits)
    ours = ours_teacher_forced(ex, prompts, cont.shape[1], cont)[0].to(ref_logits.device)
    return {"ours": token_stats(ours, ref_logits), "hf": theirs}


def teacher_forced_flips(path: str, hf32, prompts: list[list[int]], steps: int, device: str = "cuda",
                         hf_batched: bool = False) -> dict[str, dict[str, float]]:
    """Each side's bf16 logits over the same teacher-forced context (our float32 greedy
    continuation) against its own float32 ones, as :func:`token_stats`. Ours through
    ``LLM``'s executor (CUDA graphs where it has them), HF one prompt at a time unless
    ``hf_batched``."""
    logits: dict[str, torch.Tensor] = {}
    cont = None
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(path, dtype, prompts, steps, device)
        logits[dtype], fed = ours_teacher_forced(llm.engine.executor, prompts, steps, cont)
        cont = fed if cont is None else cont
        del llm
        release_memory()
    ours = token_stats(logits["bfloat16"], logits["float32"])
    del logits
    ref = hf_teacher_forced(hf32, prompts, cont, hf_batched)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    hf = token_stats(hf_teacher_forced(hf16, prompts, cont, hf_batched), ref)
    del hf16, ref
    release_memory()
    return {"ours": ours, "hf": hf}


# ---- greedy agreement ------------------------------------------------------------------

def greedy_agreement(path: str, hf32, prompts: list[list[int]], steps: int,
                     device: str = "cuda") -> dict[str, dict[str, Any]]:
    """Per side, bf16 greedy tokens against float32 ones: leading tokens identical per
    prompt (and their mean), and first differences inside float32's top-5."""
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    runs = {"hf": (hf_greedy(hf32, prompts, steps), hf_greedy(hf16, prompts, steps))}
    del hf16
    release_memory()
    ours = []
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(path, dtype, prompts, steps, device)
        ours.append(engine_greedy(llm, prompts, steps))
        del llm
        release_memory()
    runs["ours"] = (ours[0], ours[1])
    result = {}
    for side, (ref, got) in runs.items():
        leading = [leading_identical(r, g) for r, g in zip(ref, got)]
        result[side] = {"leading": leading, "mean_leading": float(np.mean(leading)), "prompts": len(prompts),
                        "top5_hits": sum(top5_at_first_difference(hf32, prompts, ref, got))}
    return result


def main() -> None:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="generated tokens per prompt")
    ap.add_argument("--std", type=float, default=0.1)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (numbers mean nothing)")
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.accuracy needs a CUDA device (or --smoke)")
    if args.smoke:
        args.prompts, args.prompt_len, args.steps = min(args.prompts, 2), min(args.prompt_len, 8), min(args.steps, 4)
    overrides = SMOKE_SHAPES if args.smoke else {}
    with tempfile.TemporaryDirectory(prefix="minivllm-accuracy-") as path:
        hf32 = make_bf16_checkpoint(path, args.std, device=device, **overrides)
        prompts = random_prompts(args.prompts, args.prompt_len, hf32.config.vocab_size)
        result = {"args": vars(args),
                  "teacher_forced": teacher_forced_flips(path, hf32, prompts, args.steps, device),
                  "greedy": greedy_agreement(path, hf32, prompts, args.steps, device)}
    for side, name in (("ours", "minivllm"), ("hf", "HF")):
        tf, g = result["teacher_forced"][side], result["greedy"][side]
        print(f"{name:>8}: teacher-forced flips {tf['flip']:.3f}, outside fp32 top-5 {tf['outside_top5']:.3f}, "
              f"logits rel. error {tf['logits_rel']:.2e}; greedy: mean {g['mean_leading']:.2f} tokens identical, "
              f"first difference in fp32 top-5 {g['top5_hits']}/{g['prompts']}")
    write_summary("accuracy", result)


if __name__ == "__main__":
    main()
