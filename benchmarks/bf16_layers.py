"""Where bf16 loses precision against float32, layer by layer: minivllm vs transformers.

    PYTHONPATH=. python3 -m benchmarks.bf16_layers [--layers 28] [--std 0.1] [--prompts 16]
        [--prompt-len 32] [--steps 64] [--decode-step 16] [--no-engine] [--smoke]

Model: Qwen3-0.6B shapes, random weights N(0, std) with norm weights 1 + 0.2 N(0, 1)
(``tests.model_utils.randomize_weights``), rounded to bf16 and saved in float32, so
the float32 and bf16 runs of both engines use the same weights (issue 7's setup).
Prompts: random ids, all of one length (HF then batches them without padding).

Sections (all printed; ``$OUT/bf16_layers.json`` when OUT is set):

1. ``gemm``: cuBLAS bf16 ``F.linear`` at the model's GEMM shapes and M = 1, 16, 512
   rows, relative error against the exact product, divided by the error of the
   ideal result (exact product rounded once to bf16): 1.0 means nothing is lost
   beyond the output rounding. Once with torch's default
   ``allow_bf16_reduced_precision_reduction`` (True: split-K partial sums may be
   reduced in bf16) and once with it off.
2. ``layers``: per layer and sub-step, ``||bf16 - fp32|| / ||fp32||`` (each engine
   against its own float32 run, same inputs), for the prefill of all prompts and for
   one batched decode step (teacher-forced: both dtypes fed the float32 greedy
   tokens). Ours runs eagerly with the compiled fused functions and the Triton
   kernels (exactly the kernels a decode graph replays), and once more with neither
   (plain torch ops, the CPU path); HF batched. The ratio table (ours / HF) shows
   the first sub-step where a gap opens.
3. ``tokens``: teacher-forced decode of the float32 greedy continuation, all steps:
   the share of (prompt, step) where the bf16 argmax differs from float32's
   ("flip"), where it is outside float32's top-5, and the logits' relative error,
   for variants that isolate one cause each (CUDA graphs, compiled fused functions,
   Triton attention, cuBLAS reduction, HF batched vs one prompt at a time). The
   flip rate is what sets how many greedy tokens stay identical, without the noise
   of 16 greedy runs.
4. ``engine`` (unless ``--no-engine``): greedy generation through ``LLM`` (CUDA
   graphs, Triton, async scheduling) vs HF ``generate`` one prompt at a time, as
   ``tests_gpu/test_bf16_accuracy.py`` measures it; and whether our engine's first
   differing bf16 token is the argmax of the teacher-forced bf16 logits on the same
   context (if not, the loss is in the engine, not in the model's numerics).

``--smoke`` runs every code path on the CPU with a tiny model (numbers mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.qwen3_shapes import QWEN3_0_6B

STEPS = ("in_norm", "qkv", "q_rope", "k_rope", "attn", "o_proj", "resid_mid", "post_norm", "act",
         "mlp", "layer_out")
SMOKE_SHAPES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
BLOCK_SIZE = 16
StepHook = Callable[[int], contextlib.AbstractContextManager]


# ---- model, prompts, greedy runs (shared with tests_gpu/test_bf16_accuracy.py) --------------

def make_bf16_checkpoint(path: str, std: float = 0.1, seed: int = 0, device: str = "cuda",
                         **overrides: Any):
    """Save a random Qwen3 (0.6B shapes unless overridden) whose weights are bf16 values
    stored in float32; return the float32 HF model (eval, on ``device``)."""
    import transformers

    from tests.model_utils import randomize_weights

    cfg = transformers.Qwen3Config(**{**QWEN3_0_6B, "bos_token_id": None, "eos_token_id": None,
                                      **overrides})
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


@torch.no_grad()
def hf_greedy(hf, prompts: list[list[int]], n: int, batched: bool = False) -> list[list[int]]:
    """HF ``generate``, greedy, ``n`` tokens, one prompt at a time (``batched``: all at
    once, which needs prompts of one length: no padding)."""
    device = next(hf.parameters()).device
    groups = [prompts] if batched else [[p] for p in prompts]
    out = []
    for group in groups:
        ids = torch.tensor(group, device=device)
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        out += gen[:, ids.shape[1]:].tolist()
    return out


def make_llm(path: str, dtype: str, prompts: list[list[int]], n: int, device: str = "cuda"):
    """Our engine as users run it on ``device`` (CUDA graphs, Triton, async scheduling on
    CUDA), with a pool just big enough (sizing from free memory would starve HF)."""
    from minivllm import LLM

    max_len = max(map(len, prompts)) + n + BLOCK_SIZE
    return LLM(path, device=device, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=len(prompts),
               max_model_len=max_len, max_num_batched_tokens=max(2048, sum(map(len, prompts))),
               num_blocks=len(prompts) * (-(-max_len // BLOCK_SIZE)) + 8, block_size=BLOCK_SIZE,
               enable_prefix_caching=False)


def engine_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy completions of ``n`` tokens through ``LLM.generate``."""
    from minivllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def release_memory() -> None:
    """Collect dropped models and return their memory to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- per-sub-step recording ------------------------------------------------------------------

class Recorder:
    """Sub-step outputs of ONE forward, in call order: ``values[step][layer]`` (float32 copies)."""

    def __init__(self) -> None:
        self.values: dict[str, list[torch.Tensor]] = defaultdict(list)

    def put(self, step: str, t: torch.Tensor) -> None:
        self.values[step].append(t.detach().float().clone())

    def hook(self, *pairs: tuple[str, Callable[[tuple, Any], torch.Tensor]]) -> Callable:
        """A forward hook recording ``get(inputs, output)`` under each step name (returns None,
        so the module's output is left alone)."""
        def hook(module: torch.nn.Module, inputs: tuple, output: Any) -> None:
            for step, get in pairs:
                self.put(step, get(inputs, output))
        return hook


def _first(x: Any) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x


@contextlib.contextmanager
def record_ours(model: torch.nn.Module, rec: Recorder) -> Iterator[None]:
    """Record our Qwen3's sub-steps (eager forwards only: a graph replay runs no hooks)."""
    import minivllm.model.decoder as decoder

    fused_qk = decoder.qk_norm_rope

    def qk_norm_rope(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        q, k, v = fused_qk(*args, **kwargs)
        rec.put("q_rope", q)
        rec.put("k_rope", k)
        return q, k, v

    hooks = [(model.model.norm, rec.hook(("final_norm", lambda i, o: _first(o))))]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        hooks += [
            (layer.input_layernorm, rec.hook(("in_norm", lambda i, o: _first(o)))),
            (attn.qkv_proj, rec.hook(("qkv", lambda i, o: o))),
            (attn.o_proj, rec.hook(("attn", lambda i, o: i[0]), ("o_proj", lambda i, o: o))),
            (layer.post_attention_layernorm,
             rec.hook(("post_norm", lambda i, o: o[0]), ("resid_mid", lambda i, o: o[1]))),
            (mlp.act_fn, rec.hook(("act", lambda i, o: o))),
            (mlp.down_proj, rec.hook(("mlp", lambda i, o: o))),
            # The residual add the next norm performs, in the model dtype like HF's.
            (layer, rec.hook(("layer_out", lambda i, o: o[0] + o[1]))),
        ]
    handles = [m.register_forward_hook(h) for m, h in hooks]
    decoder.qk_norm_rope = qk_norm_rope
    try:
        yield
    finally:
        decoder.qk_norm_rope = fused_qk
        for h in handles:
            h.remove()


def _hf_qkv_hook(rec: Recorder) -> Callable:
    """q_proj, k_proj, v_proj outputs concatenated, like our packed qkv_proj."""
    parts: list[torch.Tensor] = []

    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        parts.append(output)
        if len(parts) == 3:
            rec.put("qkv", torch.cat(parts, dim=-1))
            parts.clear()
    return hook


@contextlib.contextmanager
def record_hf(hf: torch.nn.Module, rec: Recorder) -> Iterator[None]:
    """Record HF Qwen3's sub-steps; q/k after RoPE through a wrapping attention function."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3 import modeling_qwen3

    impl = hf.config._attn_implementation
    inner = modeling_qwen3.eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]

    def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, *args: Any,
                  **kwargs: Any) -> Any:
        n = query.shape[2]                      # (B, H, n, D); key holds the cached tokens too
        rec.put("q_rope", query)
        rec.put("k_rope", key[:, :, -n:])
        return inner(module, query, key, *args, **kwargs)

    AttentionInterface.register("bf16_layers_record", attention)
    hooks = [(hf.model.norm, rec.hook(("final_norm", lambda i, o: o)))]
    for layer in hf.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _hf_qkv_hook(rec)
        hooks += [(attn.q_proj, qkv), (attn.k_proj, qkv), (attn.v_proj, qkv),
                  (layer.input_layernorm, rec.hook(("in_norm", lambda i, o: o))),
                  (attn.o_proj, rec.hook(("attn", lambda i, o: i[0]), ("o_proj", lambda i, o: o))),
                  (layer.post_attention_layernorm,
                   rec.hook(("post_norm", lambda i, o: o), ("resid_mid", lambda i, o: i[0]))),
                  (mlp.down_proj, rec.hook(("act", lambda i, o: i[0]), ("mlp", lambda i, o: o))),
                  (layer, rec.hook(("layer_out", lambda i, o: _first(o))))]
    handles = [m.register_forward_hook(h) for m, h in hooks]
    hf.config._attn_implementation = "bf16_layers_record"
    try:
        yield
    finally:
        hf.config._attn_implementation = impl
        for h in handles:
            h.remove()


def recording(phases: dict[int, str], attach: Callable[[Recorder], contextlib.AbstractContextManager]
              ) -> tuple[StepHook, dict[str, Recorder]]:
    """A step hook that records the forwards of the steps in ``phases`` (step -> phase name)."""
    recs = {name: Recorder() for name in phases.values()}

    def hook(step: int) -> contextlib.AbstractContextManager:
        return attach(recs[phases[step]]) if step in phases else contextlib.nullcontext()
    return hook, recs


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``||got - ref|| / ||ref||`` over all elements, in float64."""
    got, ref = got.double().reshape(-1), ref.double().reshape(-1)
    return ((got - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def layer_errors(r16: Recorder, r32: Recorder) -> dict[str, list[float]]:
    """Relative error of each recorded sub-step, per layer (``final_norm``: one value)."""
    return {step: [rel_error(a, b) for a, b in zip(r16.values[step], r32.values[step])]
            for step in (*STEPS, "final_norm")}


# ---- teacher-forced runs ---------------------------------------------------------------------

@torch.no_grad()
def ours_teacher_forced(ex, prompts: list[list[int]], steps: int, cont: torch.Tensor | None = None,
                        hook: StepHook | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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
        with hook(s) if hook else contextlib.nullcontext():
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


@torch.no_grad()
def hf_teacher_forced(hf, prompts: list[list[int]], cont: torch.Tensor, batched: bool = True,
                      hook: StepHook | None = None) -> torch.Tensor:
    """HF's float32 logits (steps + 1, B, V) of the prompts and then each fed token of
    ``cont`` (B, steps), decoding over a DynamicCache; ``batched=False``: one prompt at a time."""
    if not batched:
        return torch.cat([hf_teacher_forced(hf, [p], cont[i:i + 1]) for i, p in enumerate(prompts)], dim=1)
    device = next(hf.parameters()).device
    kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    cache, x, out = _new_cache(hf), torch.tensor(prompts, device=device), []
    for s in range(cont.shape[1] + 1):
        with hook(s) if hook else contextlib.nullcontext():
            out.append(hf(input_ids=x, use_cache=True, **{kw: cache}).logits[:, -1].float())
        if s < cont.shape[1]:
            x = cont[:, s:s + 1].to(device)
    return torch.stack(out)


def token_stats(logits: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Over all (step, prompt): argmax flips vs ``ref``, argmax outside ref's top-5, mean
    relative error of the logits rows."""
    got, want = logits.argmax(-1), ref.argmax(-1)
    outside = ~(ref.topk(5, dim=-1).indices == got[..., None]).any(-1)
    rows = (logits - ref).flatten(0, 1).norm(dim=-1) / ref.flatten(0, 1).norm(dim=-1)
    return {"flip": (got != want).float().mean().item(), "outside_top5": outside.float().mean().item(),
            "logits_rel": rows.mean().item()}


def teacher_forced_flips(path: str, hf32, prompts: list[list[int]], steps: int, device: str = "cuda",
                         hf_batched: bool = False) -> dict[str, dict[str, float]]:
    """Section 3 reduced to the two engines as users run them: each side's bf16 logits over
    the same teacher-forced context (our float32 greedy continuation) against its own
    float32 ones, as :func:`token_stats`. Ours through ``LLM``'s executor (CUDA graphs where
    it has them), HF one prompt at a time unless ``hf_batched``. ``tests_gpu`` asserts on it."""
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


# ---- variants: one cause switched off at a time ----------------------------------------------

@contextlib.contextmanager
def cublas_bf16_reduction(allowed: bool) -> Iterator[None]:
    """torch's ``allow_bf16_reduced_precision_reduction`` (cuBLAS may reduce split-K partial
    sums in bf16) set for the block; a no-op without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.cuda.matmul
    old = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = allowed
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = old


@contextlib.contextmanager
def ours_variant(ex, graphs: bool = True, compiled: bool = True, triton: bool = True,
                 reduced_precision: bool = True) -> Iterator[None]:
    """Run the executor ``ex`` with one or more parts of its CUDA path switched off: no graph
    replay, fused functions not compiled (``MINIVLLM_COMPILE=0``), the torch reference
    attention instead of the Triton kernels, cuBLAS reductions in fp32. Restored on exit."""
    from minivllm.layers.attention import Attention, TorchAttentionBackend

    runner, env = ex.graph_runner, os.environ.get("MINIVLLM_COMPILE")
    saved = {m: m.backend for m in ex.model.modules() if isinstance(m, Attention)}
    if not graphs:
        ex.graph_runner = None
    if not compiled:
        os.environ["MINIVLLM_COMPILE"] = "0"
    if not triton:
        for m in saved:
            m.backend = TorchAttentionBackend()
    try:
        with cublas_bf16_reduction(reduced_precision):
            yield
    finally:
        ex.graph_runner = runner
        if env is None:
            os.environ.pop("MINIVLLM_COMPILE", None)
        else:
            os.environ["MINIVLLM_COMPILE"] = env
        for m, backend in saved.items():
            m.backend = backend


OURS_VARIANTS: dict[str, dict[str, bool]] = {
    "ours: CUDA graphs (engine path)": {},
    "ours: eager": dict(graphs=False),
    "ours: eager, cuBLAS fp32 reduction": dict(graphs=False, reduced_precision=False),
    "ours: eager, fused fns not compiled": dict(graphs=False, compiled=False),
    "ours: eager, not compiled, torch attention": dict(graphs=False, compiled=False, triton=False),
}
# The variants whose sub-steps are recorded (they run eagerly), with their table names.
RECORDED = {"ours: eager": "ours", "ours: eager, not compiled, torch attention": "ours_plain"}
HF_VARIANTS: dict[str, dict[str, bool]] = {
    "hf: batched": dict(batched=True),
    "hf: batched, cuBLAS fp32 reduction": dict(batched=True, reduced_precision=False),
    "hf: one prompt at a time": dict(batched=False),
}


# ---- sections --------------------------------------------------------------------------------

def gemm_check(cfg: dict[str, Any], device: str, rows: tuple[int, ...] = (1, 16, 512)) -> list[dict]:
    """cuBLAS bf16 error / ideal bf16 error at the model's GEMM shapes (see module doc)."""
    h, d, i = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"qkv_proj": (h, nq + 2 * nkv), "q_proj": (h, nq), "k_proj,v_proj": (h, nkv),
              "o_proj": (nq, h), "gate_up_proj": (h, 2 * i), "gate_proj,up_proj": (h, i),
              "down_proj": (i, h), "lm_head": (h, cfg["vocab_size"])}
    gen = torch.Generator(device).manual_seed(0)
    out = []
    for name, (k, n) in shapes.items():
        w = (0.1 * torch.randn(n, k, generator=gen, device=device)).bfloat16()
        for m in rows:
            x = torch.randn(m, k, generator=gen, device=device).bfloat16()
            exact = x.double() @ w.double().T
            ideal = rel_error(exact.bfloat16(), exact)
            row: dict[str, Any] = {"gemm": name, "m": m, "k": k, "n": n}
            for allowed in (True, False):
                with cublas_bf16_reduction(allowed):
                    row["default" if allowed else "fp32_reduction"] = rel_error(F.linear(x, w), exact) / ideal
            out.append(row)
        del w
    return out


@dataclass
class Setup:
    """What every section shares."""

    path: str
    cfg: dict[str, Any]
    prompts: list[list[int]]
    steps: int
    phases: dict[int, str]
    device: str


def ours_reference(setup: Setup, res: dict[str, Any], engine: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Recorder]]:
    """Our float32 side: the engine's greedy run (into ``res``), then the teacher-forced
    reference run, eager and recorded. Returns its logits, the continuation, the records."""
    llm = make_llm(setup.path, "float32", setup.prompts, setup.steps, setup.device)
    if engine:
        res["engine"]["fp32"] = engine_greedy(llm, setup.prompts, setup.steps)
    ex = llm.engine.executor
    hook, rec32 = recording(setup.phases, lambda r: record_ours(ex.model, r))
    with ours_variant(ex, graphs=False):
        ref, cont = ours_teacher_forced(ex, setup.prompts, setup.steps, hook=hook)
    del llm, ex
    release_memory()
    return ref, cont, rec32


def run_ours(setup: Setup, engine: bool) -> dict[str, Any]:
    """Sections 2-4 on our side: float32 reference, then every bf16 variant on one executor."""
    res: dict[str, Any] = {"tokens": {}, "layers": {}, "engine": {}}
    ref, cont, rec32 = ours_reference(setup, res, engine)
    llm = make_llm(setup.path, "bfloat16", setup.prompts, setup.steps, setup.device)
    if engine:
        res["engine"]["bf16"] = engine_greedy(llm, setup.prompts, setup.steps)
    ex = llm.engine.executor
    graphs = None
    for name, switches in OURS_VARIANTS.items():
        hook, rec16 = (recording(setup.phases, lambda r: record_ours(ex.model, r)) if name in RECORDED
                       else (None, {}))
        t0 = time.perf_counter()
        with ours_variant(ex, **switches):
            logits, _ = ours_teacher_forced(ex, setup.prompts, setup.steps, cont, hook=hook)
        res["tokens"][name] = {**token_stats(logits, ref), "seconds": time.perf_counter() - t0}
        for phase, r in rec16.items():
            res["layers"].setdefault(phase, {})[RECORDED[name]] = layer_errors(r, rec32[phase])
        if graphs is None:  # the first variant: the engine path
            graphs = logits
            res["graph_argmax"] = logits.argmax(-1).T.tolist()  # (B, steps + 1)
        elif name == "ours: eager":
            res["graph_vs_eager_max_abs_diff"] = (graphs - logits).abs().max().item()
        del logits, rec16
    del llm, ex, graphs, ref
    release_memory()
    res["cont"] = cont
    return res


def run_hf(setup: Setup, hf32, cont: torch.Tensor, engine: bool) -> dict[str, Any]:
    """Sections 2-4 on HF's side (its float32 model is the reference of its variants)."""
    res: dict[str, Any] = {"tokens": {}, "layers": {}, "engine": {}}
    hook, rec32 = recording(setup.phases, lambda r: record_hf(hf32, r))
    ref = hf_teacher_forced(hf32, setup.prompts, cont, hook=hook)
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    for name, switches in HF_VARIANTS.items():
        recorded = name == "hf: batched"
        hook, rec16 = recording(setup.phases, lambda r: record_hf(hf16, r)) if recorded else (None, {})
        t0 = time.perf_counter()
        with cublas_bf16_reduction(switches.get("reduced_precision", True)):
            logits = hf_teacher_forced(hf16, setup.prompts, cont, switches["batched"], hook)
        res["tokens"][name] = {**token_stats(logits, ref), "seconds": time.perf_counter() - t0}
        for phase, r in rec16.items():
            res["layers"].setdefault(phase, {})["hf"] = layer_errors(r, rec32[phase])
        del logits, rec16
    del ref, rec32
    if engine:
        res["engine"]["fp32"] = hf_greedy(hf32, setup.prompts, setup.steps)
        res["engine"]["bf16"] = hf_greedy(hf16, setup.prompts, setup.steps)
    del hf16
    release_memory()
    return res


def engine_summary(hf32, setup: Setup, ours: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """Greedy leads and top-5 checks of both engines, and our engine's self-consistency."""
    prompts, cont = setup.prompts, ours["cont"]
    out: dict[str, Any] = {}
    for side, runs in (("ours", ours["engine"]), ("hf", hf["engine"])):
        leads = [leading_identical(r, g) for r, g in zip(runs["fp32"], runs["bf16"])]
        top5 = top5_at_first_difference(hf32, prompts, runs["fp32"], runs["bf16"])
        out[side] = {"leading_identical": leads, "mean_leading": float(np.mean(leads)),
                     "top5_at_first_difference": sum(top5)}
    # Where our engine's bf16 first differs from its fp32 run on a context the teacher-forced
    # run also saw, the engine's token must be the graph run's argmax there (same kernels).
    checks = []
    for b, (r, g) in enumerate(zip(ours["engine"]["fp32"], ours["engine"]["bf16"])):
        k = leading_identical(r, g)
        if k < len(g) and r[:k] == cont[b, :k].tolist():
            checks.append(ours["graph_argmax"][b][k] == g[k])
    out["ours_engine_fp32_equals_executor_greedy"] = [
        leading_identical(cont[b].tolist(), r) == len(r) for b, r in enumerate(ours["engine"]["fp32"])]
    out["ours_engine_bf16_token_is_graph_argmax"] = checks
    return out


# ---- report ----------------------------------------------------------------------------------

def _cell(errs: dict[str, list[float]], c: str, layer: int) -> float:
    """A sub-step's error, nan where it was not recorded (the fused q/k kernel has no q/k hooks)."""
    values = errs.get(c, [])
    return values[layer] if layer < len(values) else float("nan")


def print_layer_tables(phase: str, tables: dict[str, dict[str, list[float]]]) -> None:
    """Per layer x sub-step error tables of one phase, then ours / HF ratios."""
    for name, errs in tables.items():
        print(f"\n[{phase}] {name}: ||bf16 - fp32|| / ||fp32||")
        print("layer " + " ".join(f"{c:>10}" for c in STEPS))
        for layer in range(len(errs["in_norm"])):
            print(f"{layer:5d} " + " ".join(f"{_cell(errs, c, layer):10.2e}" for c in STEPS))
        print(f"final_norm {errs['final_norm'][0]:.2e}")
    if "ours" in tables and "hf" in tables:
        ours, hf = tables["ours"], tables["hf"]
        print(f"\n[{phase}] ratio ours / HF (> 1: ours loses more)")
        print("layer " + " ".join(f"{c:>10}" for c in STEPS))
        for layer in range(len(ours["in_norm"])):
            print(f"{layer:5d} " + " ".join(
                f"{_cell(ours, c, layer) / max(_cell(hf, c, layer), 1e-30):10.2f}" for c in STEPS))
        means = [np.mean(ours.get(c) or [np.nan]) / max(np.mean(hf.get(c) or [np.nan]), 1e-30) for c in STEPS]
        print(" mean " + " ".join(f"{m:10.2f}" for m in means))
        print(f"final_norm {ours['final_norm'][0] / max(hf['final_norm'][0], 1e-30):.2f}")


def print_report(report: dict[str, Any]) -> None:
    """Everything ``main`` measured, as tables."""
    if report["gemm"]:
        print("\n[gemm] cuBLAS bf16 error / ideal (exact product rounded once); 1.0 = nothing lost")
        print(f"{'gemm':<18}{'M':>5}{'K':>7}{'N':>8}{'default':>10}{'fp32 red.':>10}")
        for r in report["gemm"]:
            print(f"{r['gemm']:<18}{r['m']:>5}{r['k']:>7}{r['n']:>8}{r['default']:>10.2f}{r['fp32_reduction']:>10.2f}")
    print("\n[tokens] teacher-forced on the float32 greedy continuation, every (prompt, step)")
    print(f"{'variant':<46}{'flip':>8}{'>top5':>8}{'logits rel':>12}{'s':>7}")
    for name, s in report["tokens"].items():
        print(f"{name:<46}{s['flip']:8.3f}{s['outside_top5']:8.3f}{s['logits_rel']:12.3e}{s['seconds']:7.1f}")
    for phase, tables in report["layers"].items():
        print_layer_tables(phase, tables)
    if "graph_vs_eager_max_abs_diff" in report:
        print(f"ours graphs vs eager, same kernels: max |logits diff| = {report['graph_vs_eager_max_abs_diff']:.3e}")
    eng = report.get("engine")
    if eng:
        print("\n[engine] greedy: leading tokens identical to float32, first difference in fp32 top-5")
        for side in ("ours", "hf"):
            e = eng[side]
            print(f"{side:<5} mean {e['mean_leading']:6.2f}  top-5 {e['top5_at_first_difference']:2d}/"
                  f"{len(e['leading_identical'])}  leads {e['leading_identical']}")
        ratio = eng["ours"]["mean_leading"] / max(eng["hf"]["mean_leading"], 1e-9)
        print(f"ours / hf mean leading tokens: {ratio:.2f} (target >= 0.90)")
        print(f"ours engine fp32 == executor greedy: {sum(eng['ours_engine_fp32_equals_executor_greedy'])}/"
              f"{len(eng['ours_engine_fp32_equals_executor_greedy'])};  engine bf16 first-difference token "
              f"== graph argmax on that context: {sum(eng['ours_engine_bf16_token_is_graph_argmax'])}/"
              f"{len(eng['ours_engine_bf16_token_is_graph_argmax'])}")


def write_json(report: dict[str, Any]) -> None:
    """$OUT/bf16_layers.json when OUT is set."""
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bf16_layers.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"written to {path}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"])
    ap.add_argument("--std", type=float, default=0.1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="decode steps (generated tokens)")
    ap.add_argument("--decode-step", type=int, default=16, help="decode step whose sub-steps are tabled")
    ap.add_argument("--no-engine", action="store_true", help="skip the greedy generate section")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (numbers mean nothing)")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    return ap.parse_args()


def main() -> None:
    import tempfile

    args = parse_args()
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bf16_layers needs a CUDA device (or --smoke)")
    overrides = dict(num_hidden_layers=args.layers, **(SMOKE_SHAPES if args.smoke else {}))
    cfg = {**QWEN3_0_6B, **overrides}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or tmp
        t0 = time.perf_counter()
        hf32 = make_bf16_checkpoint(path, args.std, device=device, **overrides)
        prompts = random_prompts(args.prompts, args.prompt_len, cfg["vocab_size"])
        setup = Setup(path, cfg, prompts, args.steps, {0: "prefill", args.decode_step: "decode"}, device)
        report: dict[str, Any] = {"config": {**cfg, "std": args.std, "prompts": args.prompts,
                                             "prompt_len": args.prompt_len, "steps": args.steps,
                                             "decode_step": args.decode_step, "torch": torch.__version__}}
        report["gemm"] = gemm_check(cfg, device) if device == "cuda" else []
        ours = run_ours(setup, not args.no_engine)
        hf = run_hf(setup, hf32, ours["cont"], not args.no_engine)
        report["layers"] = {p: {**ours["layers"].get(p, {}), **hf["layers"].get(p, {})}
                            for p in setup.phases.values()}
        report["tokens"] = {**ours["tokens"], **hf["tokens"]}
        report["graph_vs_eager_max_abs_diff"] = ours.get("graph_vs_eager_max_abs_diff")
        if not args.no_engine:
            report["engine"] = engine_summary(hf32, setup, ours, hf)
        report["seconds"] = time.perf_counter() - t0
    write_json(report)  # first: the report survives a printing error
    print_report(report)


if __name__ == "__main__":
    main()
