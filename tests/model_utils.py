"""Helpers for model tests: tiny random Hugging Face checkpoints (Qwen3, Qwen2, Llama) and plans."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping

import numpy as np
import torch
import transformers

from minivllm.engine.plan import StepPlan
from minivllm.sampling import SamplingParams

if TYPE_CHECKING:
    from minivllm.executor.model_executor import ModelExecutor


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
