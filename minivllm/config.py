"""Frozen, validated configuration dataclasses.

Every config is a frozen dataclass validated in ``__post_init__``: a bad value
raises ``ValueError`` naming the field. ``from_dict`` rejects unknown keys, so a
typo in a dict or CLI option is an error rather than a silently ignored setting.
Derived values (e.g. the number of KV blocks that the executor found room for)
enter through ``dataclasses.replace``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal, Mapping, TypeVar

T = TypeVar("T")

Policy = Literal["prefill_first", "mixed"]
POLICIES: tuple[str, ...] = ("prefill_first", "mixed")


def _from_dict(cls: type[T], values: Mapping[str, Any]) -> T:
    """Build ``cls`` from a mapping; unknown keys raise ``ValueError``."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown {cls.__name__} key(s): {unknown}; valid keys: {sorted(names)}")
    return cls(**values)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


# The weight block of Qwen3-FP8 checkpoints (weight_scale_inv per 128 x 128 weights).
FP8_WEIGHT_BLOCK: tuple[int, int] = (128, 128)
# KV cache dtypes by vLLM's names: "auto" is the model's dtype; "fp8" and "fp8_e4m3" are two names
# of one cache (e4m3 values with per-layer scales), as in vLLM, and the code asks only
# ``CacheConfig.fp8``.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block (a power of two, so kernels can index
            with shifts and any block size works for every kernel).
        num_blocks: size of the block pool; ``None`` lets the executor decide
            (the CUDA executor sizes it from free memory).
        enable_prefix_caching: reuse full blocks across requests by chained hash.
        kv_cache_dtype: one of ``KV_CACHE_DTYPES``: the model's dtype, or e4m3 values with a
            per-tensor scale per layer, half the bytes of bf16, so twice the blocks in the
            same memory (vLLM's option of the same name).
        state_snapshot_interval: hybrid models (recurrent state beside the KV cache): the
            prefix cache keeps the state at every this-many-th full block boundary and at
            a prompt's last full block, where a later hit may resume (``engine/state_cache.py``;
            a state weighs much more than a block's K/V: docs/design.md, "Hybrid models").
    """

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    state_snapshot_interval: int = 32

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None:
            _check_int("num_blocks", self.num_blocks, 1)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_int("state_snapshot_interval", self.state_snapshot_interval, 1)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @property
    def fp8(self) -> bool:
        """Whether the cache holds e4m3 values (either FP8 name)."""
        return self.kv_cache_dtype != "auto"

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "CacheConfig":
        return _from_dict(cls, values)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and policy.

    Attributes:
        max_num_seqs: most sequences in one step (and in the running queue).
        max_num_batched_tokens: token budget of one step.
        max_model_len: most tokens (prompt + completion) of one sequence.
        policy: ``prefill_first`` schedules waiting/prefill work before decodes
            (a step is either all prefill or all decode); ``mixed`` schedules
            decodes first and fills the rest of the budget with prefill chunks.
        chunked_prefill: allow a prompt to be computed over several steps.
            Without it a whole (re)computation must fit in one step's budget, so
            ``max_num_batched_tokens >= max_model_len`` is required.
        async_scheduling: keep one step in flight: schedule and submit step N+1
            while step N runs (docs/design.md, "Asynchronous steps"). Outputs are the
            same as synchronous scheduling's. ``LLM`` turns it on for CUDA.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    policy: Policy = "mixed"
    chunked_prefill: bool = True
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 2)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        _check_bool("chunked_prefill", self.chunked_prefill)
        _check_bool("async_scheduling", self.async_scheduling)
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked_prefill is off "
                f"(got {self.max_num_batched_tokens} < {self.max_model_len}): a sequence "
                "recomputed after preemption could otherwise never be scheduled"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SchedulerConfig":
        return _from_dict(cls, values)


SPEC_METHODS: tuple[str, ...] = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``, its names): a proposer suggests up
    to ``num_speculative_tokens`` draft tokens per decoding sequence, and one forward of the
    model scores them all (docs/design.md, "Speculative decoding").

    Attributes:
        method: ``ngram``: prompt lookup, the tokens that followed the latest earlier
            occurrence of the context's last n tokens (``minivllm/spec/ngram.py``);
            ``draft_model``: a smaller model with the target's vocabulary drafts greedily,
            in the target's executor (``minivllm/spec/draft_model.py``); ``mtp``: the model's
            own multi-token-prediction head (Qwen3.5, Qwen3-Next; ``minivllm/executor/mtp.py``).
            None (the default): ``draft_model`` when ``model`` is given, else ``ngram``.
        model: the draft model's directory (``draft_model`` only).
        num_speculative_tokens: most drafts per sequence and step (k), 1..16.
        prompt_lookup_min / prompt_lookup_max: the n-gram lengths tried, longest first
            (vLLM's defaults: 5 and 5 when neither is given, the other one when one is).
    """

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        method = self.method if self.method is not None else ("draft_model" if self.model is not None else "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, got {self.method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an int in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError(f"speculative_config.model: method 'draft_model' needs the draft model's "
                                 f"directory, got {self.model!r}")
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram', not 'draft_model'")
            return
        if self.model is not None:
            raise ValueError(f"speculative_config.model is for method 'draft_model', not {method!r}")
        if method == "mtp":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is for method 'ngram', not 'mtp'")
            return
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)  # the defaults, resolved
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "SpeculativeConfig":
        return _from_dict(cls, values)


DTYPE_NAMES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
KERNEL_CHOICES: tuple[str, ...] = ("auto", "triton", "torch")
LoadFormat = Literal["auto", "dummy"]
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")
QUANTIZATIONS: tuple[str | None, ...] = (None, "fp8")


@dataclass(frozen=True)
class ExecutorConfig:
    """How the model executor runs (the batch limits come from the scheduler and cache configs).

    Attributes:
        device: ``auto`` (cuda if available, else cpu), ``cpu``, ``cuda``, ``cuda:1``...
        dtype: ``auto`` (bfloat16 on cuda, float32 on cpu), ``float32``, ``bfloat16``, ``float16``.
        kernels: ``auto`` (our Triton kernels on cuda, the torch references elsewhere),
            ``triton`` (on the CPU only under ``TRITON_INTERPRET=1``: tests), or ``torch``:
            the references for every op (norms, GEMVs, attention, ...).
        seed: seed of the sampler's stream for requests without a seed of their own.
        enforce_eager: never use CUDA graphs (of decode, prefill or mixed steps).
        gpu_memory_utilization: fraction of the device's memory the executor may use.
        tensor_parallel_size: ranks the model is split over, one process each
            (``executor/distributed.py``).
        disable_custom_all_reduce: with ``tensor_parallel_size > 1`` on CUDA, send every
            all-reduce through NCCL instead of the symmetric-memory kernels
            (``ops/communicator.py``; vLLM's option of the same name).
        load_format: ``auto`` (the checkpoint's safetensors or GGUF weights) or ``dummy``
            (random weights filled on the device, ``model/loader.py: fill_dummy_weights``:
            only config.json is read; vLLM's option of the same name).
        quantization: None (the checkpoint's weights as they are: 16-bit, or FP8 where its
            ``quantization_config`` says so) or ``fp8``: a 16-bit checkpoint's linear layers
            quantized at load to e4m3 with per-output-channel scales, activations per token
            (vLLM's option of the same name; an FP8 checkpoint keeps its block scales).
    """

    device: str = "auto"
    dtype: str = "auto"
    kernels: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    disable_custom_all_reduce: bool = False
    load_format: LoadFormat = "auto"
    quantization: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a non-empty str, got {self.device!r}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {self.kernels!r}")
        _check_int("seed", self.seed, -(1 << 63))
        _check_bool("enforce_eager", self.enforce_eager)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_bool("disable_custom_all_reduce", self.disable_custom_all_reduce)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ExecutorConfig":
        return _from_dict(cls, values)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


# Qwen3-Next (Qwen3-Next-80B-A3B): the Qwen3.5 hybrid's layers with its DeltaNet projections fused
# per key head, dense and sparse layers mixed as Qwen3-MoE mixes them (``model/qwen3_next.py``).
QWEN3_NEXT = "Qwen3NextForCausalLM"
# The model classes there are (``minivllm/model/registry.py`` maps each name to its class).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2ForCausalLM",
                                             "LlamaForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                             "Qwen3_5ForConditionalGeneration",
                                             "Qwen3_5MoeForConditionalGeneration", QWEN3_NEXT)
# Hybrid architectures: Gated DeltaNet (linear attention) layers beside gated full attention.
HYBRID_ARCHITECTURES: tuple[str, ...] = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                          "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                                          QWEN3_NEXT)
# Architectures with a sparse MLP (the routed experts of ``layers/moe.py``).
MOE_ARCHITECTURES: tuple[str, ...] = ("Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM",
                                       "Qwen3_5MoeForConditionalGeneration", QWEN3_NEXT)
# Qwen3.5-MoE: every layer's MLP routed (config.json may lack intermediate_size), the top-k
# weights always renormalised.
ALL_SPARSE_ARCHITECTURES: tuple[str, ...] = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
# The config.json key of the MTP head's layer count, where it is not ``mtp_num_hidden_layers``.
MTP_LAYERS_KEYS: Mapping[str, str] = MappingProxyType({QWEN3_NEXT: "num_nextn_predict_layers"})
# The vision-language checkpoints whose config.json keeps the text model under ``text_config``.
NESTED_TEXT_ARCHITECTURES: tuple[str, ...] = ("Qwen3_5ForConditionalGeneration",
                                               "Qwen3_5MoeForConditionalGeneration")
# ``layer_types`` values: what mixes the tokens of a layer.
LayerKind = Literal["full_attention", "linear_attention"]
LAYER_KINDS: tuple[str, ...] = ("full_attention", "linear_attention")
# RoPE types we implement (``rope_type`` in config.json; "default" is plain RoPE).
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "llama3")
# Hugging Face's theta when config.json names none.
HF_DEFAULT_ROPE_THETA = 10_000.0
# Keys a RoPE dict may hold (both spellings); the scaling ones only with a scaled type.
_ROPE_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# The multimodal RoPE's keys (Qwen3.5): a text token has one position in all three sections, so
# the sections select the same frequencies and the rotation is plain RoPE of that position.
_MROPE_KEYS = frozenset({"mrope_section", "mrope_interleaved"})
# The hybrids' partial_rotary_factor when config.json gives none (transformers' default for them).
QWEN3_5_PARTIAL_ROTARY_FACTOR = 0.25
_LLAMA3_KEYS = frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})


def _check_real(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: "llama3"``), applied by
    ``minivllm.layers.rotary``.

    With ``L = original_max_position_embeddings`` and each frequency's wavelength
    ``w = 2 pi / f``: ``w < L / high_freq_factor`` keeps ``f``; ``w > L / low_freq_factor``
    becomes ``f / factor``; in between, ``f`` is interpolated between the two by
    ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

    Raises:
        ValueError: a non-finite or non-positive number, ``factor < 1``, or
            ``high_freq_factor <= low_freq_factor`` (the interpolation divides by their difference).
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            _check_real(f"rope llama3 {name}", getattr(self, name))
        if self.factor < 1:
            raise ValueError(f"rope llama3 factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError("rope llama3 needs 0 < low_freq_factor < high_freq_factor, got "
                             f"{self.low_freq_factor}, {self.high_freq_factor}")
        _check_int("rope llama3 original_max_position_embeddings", self.original_max_position_embeddings, 1)


@dataclass(frozen=True)
class ModelConfig:
    """The model's shapes, converted once from a Hugging Face ``config.json``.

    ``from_hf_json`` is the only place in the code base that reads that file.
    What a family hard-codes rather than configures (Qwen2's q/k/v bias, Qwen3's
    q/k norm) is stated by its model class (``minivllm/model/``), not here.

    Attributes (beyond the shapes):
        rope_theta: RoPE base, finite and positive.
        rope_scaling: Llama 3.1 frequency scaling, or None for plain RoPE.
        tie_word_embeddings: the LM head is the embedding matrix.
        attention_bias: config.json's ``attention_bias`` (Llama, Qwen3: bias on
            q/k/v/o; Qwen2 has no such switch, its q/k/v always carry a bias).
        architecture: ``architectures[0]``, one of ``SUPPORTED_ARCHITECTURES``.
        num_experts: experts of a sparse MLP layer (Qwen3-MoE); 0: every layer is dense.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: each expert's intermediate size.
        norm_topk_prob: the top-k routing weights are renormalised to sum to 1.
        decoder_sparse_step, mlp_only_layers: layer i is sparse iff i is not in
            ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``
            (``is_sparse_layer``); the others have the dense MLP of ``intermediate_size``.
        quantization: the checkpoint's FP8 format (``quantization_config``, Qwen3-FP8's
            128x128 block scales), or None: 16-bit weights.
        layer_types: hybrid models: each layer's token mixer, ``"full_attention"`` or
            ``"linear_attention"`` (Gated DeltaNet); ``()``: every layer full attention.
        linear_conv_kernel_dim: the DeltaNet's causal depthwise conv width K (its conv state
            keeps the last K - 1 inputs).
        linear_key_head_dim, linear_value_head_dim: DeltaNet q/k and v head sizes.
        linear_num_key_heads, linear_num_value_heads: DeltaNet q/k heads and v heads; each q/k
            head serves ``linear_num_value_heads // linear_num_key_heads`` consecutive v heads.
        partial_rotary_factor: the share of ``head_dim`` that RoPE rotates (the leading dims).
        attn_output_gate: q_proj also yields a per-head gate; sigmoid(gate) scales the
            attention output before o_proj (Qwen3.5, Qwen3-Next).
        shared_expert_intermediate_size: a sparse layer's shared expert (always on, scaled by a
            per-token sigmoid gate); 0: none.
        mtp_num_hidden_layers, mtp_use_dedicated_embeddings: the multi-token-prediction head's
            shape (Qwen3-Next's config.json names the first ``num_nextn_predict_layers``);
            speculative decoding's ``method: "mtp"`` runs the head (its weights are skipped
            otherwise).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # One id, or every id that ends a sequence (Llama-3.x instruct: <|end_of_text|>,
    # <|eom_id|>, <|eot_id|>), from config.json and generation_config.json.
    eos_token_id: int | tuple[int, ...] | None = None
    bos_token_id: int | None = None
    architecture: str = "Qwen3ForCausalLM"
    torch_dtype: str | None = None
    rope_scaling: Llama3RopeScaling | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    quantization: Fp8Config | None = None
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    shared_expert_intermediate_size: int = 0
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            _check_int(name, getattr(self, name), 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        _check_real("rope_theta", self.rope_theta)
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive and finite, got {self.rope_theta}")
        _check_real("rms_norm_eps", self.rms_norm_eps)
        if not (self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _check_bool("tie_word_embeddings", self.tie_word_embeddings)
        _check_bool("attention_bias", self.attention_bias)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"rope_scaling must be None or Llama3RopeScaling, got {self.rope_scaling!r}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        self._check_experts()
        self._check_hybrid()

    def _check_experts(self) -> None:
        _check_int("num_experts", self.num_experts, 0)
        _check_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size, 0)
        if self.shared_expert_intermediate_size and self.architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}: "
                             f"{self.architecture} has no shared expert")
        if self.num_experts == 0:
            if self.shared_expert_intermediate_size:
                raise ValueError("shared_expert_intermediate_size is set without experts (num_experts=0)")
            return
        if self.architecture not in MOE_ARCHITECTURES:
            raise ValueError(f"num_experts={self.num_experts}: only {MOE_ARCHITECTURES} have experts")
        _check_int("num_experts_per_tok", self.num_experts_per_tok, 1)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts "
                             f"({self.num_experts})")
        _check_int("moe_intermediate_size", self.moe_intermediate_size, 1)
        _check_int("decoder_sparse_step", self.decoder_sparse_step, 1)
        _check_bool("norm_topk_prob", self.norm_topk_prob)
        if not isinstance(self.mlp_only_layers, tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.num_hidden_layers
                for i in self.mlp_only_layers):
            raise ValueError(f"mlp_only_layers must be a tuple of layer indices in [0, {self.num_hidden_layers}), "
                             f"got {self.mlp_only_layers!r}")

    def _check_hybrid(self) -> None:
        """The hybrid fields: layer kinds, the DeltaNet shapes, partial RoPE, the output gate."""
        hybrid = self.architecture in HYBRID_ARCHITECTURES
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) not in (0, self.num_hidden_layers):
            raise ValueError(f"layer_types must be a tuple of {self.num_hidden_layers} layer kinds (or empty), "
                             f"got {self.layer_types!r}")
        unknown = sorted({k for k in self.layer_types if k not in LAYER_KINDS}, key=str)
        if unknown:
            raise ValueError(f"layer_types has unsupported kind(s) {unknown}; supported: {LAYER_KINDS}")
        if self.num_linear_layers and not hybrid:
            raise ValueError(f"layer_types: {self.architecture} has no linear_attention layers")
        if self.num_linear_layers:
            for name in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                         "linear_num_key_heads", "linear_num_value_heads"):
                _check_int(name, getattr(self, name), 2 if name == "linear_conv_kernel_dim" else 1)
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                                 f"linear_num_key_heads ({self.linear_num_key_heads})")
        _check_real("partial_rotary_factor", self.partial_rotary_factor)
        if self.partial_rotary_factor != 1.0 and not hybrid:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor}: {self.architecture} rotates "
                             "the whole head")
        rotary = self.head_dim * self.partial_rotary_factor
        if not 0 < self.partial_rotary_factor <= 1 or rotary != int(rotary) or int(rotary) % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even rotary dim "
                             f"in (0, head_dim={self.head_dim}], got {rotary}")
        _check_bool("attn_output_gate", self.attn_output_gate)
        if hybrid and self.quantization is not None:
            raise ValueError(f"quantization_config: FP8 checkpoints of {self.architecture} are not served yet")
        if self.attn_output_gate and not hybrid:
            raise ValueError(f"attn_output_gate: {self.architecture} has no attention output gate")
        _check_int("mtp_num_hidden_layers", self.mtp_num_hidden_layers, 0)
        _check_bool("mtp_use_dedicated_embeddings", self.mtp_use_dedicated_embeddings)

    def layer_kind(self, layer_idx: int) -> LayerKind:
        """Layer ``layer_idx``'s token mixer (full attention unless ``layer_types`` says otherwise)."""
        return self.layer_types[layer_idx] if self.layer_types else "full_attention"  # type: ignore[return-value]

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer is linear attention (a state slot per sequence beside its KV blocks)."""
        return self.num_linear_layers > 0

    @property
    def num_linear_layers(self) -> int:
        """Linear-attention layers: the first dimension of the state tensors."""
        return sum(k == "linear_attention" for k in self.layer_types)

    @property
    def num_attention_layers(self) -> int:
        """Full-attention layers: how many layers the KV cache needs."""
        return self.num_hidden_layers - self.num_linear_layers

    def kind_index(self, layer_idx: int) -> int:
        """Layer ``layer_idx``'s index among the layers of its kind: its row of the KV cache (full
        attention) or of the state tensors (linear attention)."""
        kind = self.layer_kind(layer_idx)
        return sum(self.layer_kind(i) == kind for i in range(layer_idx))

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet conv: q, k and v concatenated."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def conv_state_shape(self, num_slots: int, tp_size: int = 1) -> tuple[int, int, int, int]:
        """(num_linear_layers, num_slots, conv_dim / tp_size, kernel - 1): every slot's last conv
        inputs on one of ``tp_size`` ranks (its q, k and v heads' channels), model dtype.

        Raises:
            ValueError: the DeltaNet heads do not split over ``tp_size`` (``linear_heads_per_rank``).
        """
        key_heads, value_heads = self.linear_heads_per_rank(tp_size)
        channels = 2 * key_heads * self.linear_key_head_dim + value_heads * self.linear_value_head_dim
        return (self.num_linear_layers, num_slots, channels, self.linear_conv_kernel_dim - 1)

    def recurrent_state_shape(self, num_slots: int, tp_size: int = 1) -> tuple[int, int, int, int, int]:
        """(num_linear_layers, num_slots, v_heads / tp_size, head_k_dim, head_v_dim): every slot's
        delta-rule state on one of ``tp_size`` ranks (its value heads), float32.

        Raises:
            ValueError: the DeltaNet heads do not split over ``tp_size`` (``linear_heads_per_rank``).
        """
        _, value_heads = self.linear_heads_per_rank(tp_size)
        return (self.num_linear_layers, num_slots, value_heads, self.linear_key_head_dim,
                self.linear_value_head_dim)

    def linear_heads_per_rank(self, tp_size: int) -> tuple[int, int]:
        """(q/k heads, value heads) of the DeltaNet on each of ``tp_size`` ranks: both counts split
        evenly, so each rank's value heads are those of its own q/k heads (a value head reads
        q/k head ``v // (linear_num_value_heads // linear_num_key_heads)``).

        Raises:
            ValueError: naming ``linear_num_key_heads`` or ``linear_num_value_heads`` when it
                does not divide by ``tp_size``.
        """
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(self, name) % tp_size:
                raise ValueError(f"{name} ({getattr(self, name)}) is not divisible by tp_size ({tp_size})")
        return self.linear_num_key_heads // tp_size, self.linear_num_value_heads // tp_size

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` routes to experts (transformers' rule for Qwen3-MoE)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_json(cls, path: str | os.PathLike[str]) -> "ModelConfig":
        """Read a Hugging Face ``config.json`` (or the directory holding it): see
        :meth:`from_hf_dict`. (A GGUF file's metadata is turned into the same keys on the
        model side: ``minivllm.model.hf_config.read_model_config``.)

        Raises:
            ValueError: unsupported architecture or feature, or a missing/invalid field.
        """
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f), path)

    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], path: str | os.PathLike[str]) -> "ModelConfig":
        """Our ``ModelConfig`` from the keys of a Hugging Face ``config.json`` read from
        ``path`` (named in errors; a ``generation_config.json`` beside it adds its eos ids).

        RoPE settings are read in both spellings (see ``_read_rope``). What we cannot
        honour is refused rather than run wrong: a RoPE type other than
        ``SUPPORTED_ROPE_TYPES``, sliding-window layers, an activation other than
        SiLU, an MLP bias.

        Raises:
            ValueError: unsupported architecture or feature, or a missing/invalid field.
        """
        archs = hf.get("architectures") or []
        if not archs or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{path}: unsupported architectures {archs}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        if archs[0] in NESTED_TEXT_ARCHITECTURES:
            hf = _text_config(hf, path)
        # Qwen3.5-MoE has no dense MLP, hence no intermediate_size: no layer reads it then.
        if archs[0] in ALL_SPARSE_ARCHITECTURES and "intermediate_size" not in hf:
            hf = {**hf, "intermediate_size": hf.get("moe_intermediate_size")}
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [k for k in required if hf.get(k) is None]
        if missing:
            raise ValueError(f"{path}: config.json lacks required field(s) {missing}")
        _refuse_unsupported(hf, archs[0], path)
        heads = hf["num_attention_heads"]
        # HF's rule: absent or null means one KV head per query head; a 0 stays 0 and
        # is refused by validation rather than read as the default.
        kv_heads = hf.get("num_key_value_heads")
        max_positions = hf.get("max_position_embeddings", 40960)
        rope_theta, rope_scaling, partial_rotary = _read_rope(hf, max_positions, path,
                                                              hybrid=archs[0] in HYBRID_ARCHITECTURES)
        eos = _read_eos(hf, os.path.dirname(path), path)
        arch = archs[0]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=rope_theta,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)),
            eos_token_id=eos,
            bos_token_id=hf.get("bos_token_id"),
            architecture=arch,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            rope_scaling=rope_scaling,
            quantization=_read_quantization(hf, path),
            partial_rotary_factor=partial_rotary,
            **_read_experts(hf, arch, path),
            **_read_hybrid(hf, arch, path),
        )


# Keys of a vision-language config.json's top level that describe the text model too: the top
# level's value wins (as transformers reads them), and a differing tie_word_embeddings is refused.
_TOP_LEVEL_TEXT_KEYS = ("tie_word_embeddings", "quantization_config", "torch_dtype", "dtype")


def _text_config(hf: Mapping[str, Any], path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``*ForConditionalGeneration`` config.json's text model as one flat dict: its
    ``text_config``, with the top level's architecture and the keys of ``_TOP_LEVEL_TEXT_KEYS``.
    ``vision_config`` is dropped: the engine serves text only (the loader skips the vision tower).

    Raises:
        ValueError: no ``text_config`` dict, or ``tie_word_embeddings`` given differently at the
            two levels.
    """
    text = hf.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"{path}: {hf['architectures'][0]} needs a text_config dict, got {text!r}")
    flat = {**text, "architectures": hf["architectures"], **{k: hf[k] for k in _TOP_LEVEL_TEXT_KEYS if k in hf}}
    tied = "tie_word_embeddings"
    if tied in hf and text.get(tied, hf[tied]) != hf[tied]:
        raise ValueError(f"{path}: {tied} is {hf[tied]!r} at the top level but {text[tied]!r} in text_config")
    return flat


def _read_hybrid(hf: Mapping[str, Any], architecture: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The hybrids' fields (none for another architecture): ``layer_types`` (or, without
    it, every ``full_attention_interval``-th layer full attention, transformers' rule), the
    DeltaNet shapes, the attention output gate (always on in transformers' Qwen3.5 and
    Qwen3-Next) and the MTP head's shape: Qwen3.5's ``mtp_num_hidden_layers`` (0 when absent);
    Qwen3-Next's ``num_nextn_predict_layers``, 1 when absent as vLLM reads it (its released
    checkpoints carry one MTP layer and no such key).

    Raises:
        ValueError: ``layer_types`` and ``full_attention_interval`` disagree, a state dtype
            other than float32 (``mamba_ssm_dtype``: the recurrent state is float32), or for
            Qwen3-Next ``attn_output_gate`` false (transformers gates its attention anyway) or
            no ``head_dim`` (transformers' default is 256, not hidden_size / heads).
    """
    if architecture not in HYBRID_ARCHITECTURES:
        return {}
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    _check_int("full_attention_interval", interval, 1)
    derived = tuple("linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers))
    kinds = hf.get("layer_types")
    kinds = derived if kinds is None else tuple(kinds)
    if "full_attention_interval" in hf and kinds != derived:
        raise ValueError(f"{path}: layer_types {list(kinds)} disagree with full_attention_interval {interval}")
    ssm_dtype = hf.get("mamba_ssm_dtype", "float32")
    if ssm_dtype != "float32":
        raise ValueError(f"{path}: mamba_ssm_dtype {ssm_dtype!r} is not served (the recurrent state is float32)")
    names = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
             "linear_num_value_heads")
    missing = [k for k in names if hf.get(k) is None]
    if missing:
        raise ValueError(f"{path}: config.json lacks required field(s) {missing}")
    if architecture == QWEN3_NEXT and hf.get("head_dim") is None:
        raise ValueError(f"{path}: config.json lacks head_dim (transformers' {architecture} takes 256 without it, "
                         "not hidden_size / num_attention_heads)")
    gate = hf.get("attn_output_gate", True)
    if architecture == QWEN3_NEXT and gate is not True:
        raise ValueError(f"{path}: attn_output_gate {gate!r} is not served for {architecture}: its attention is "
                         "always gated (its checkpoints' q_proj holds the gate)")
    mtp_key = MTP_LAYERS_KEYS.get(architecture, "mtp_num_hidden_layers")
    return dict(layer_types=kinds, attn_output_gate=gate,
                mtp_num_hidden_layers=hf.get(mtp_key, 1 if architecture == QWEN3_NEXT else 0),
                mtp_use_dedicated_embeddings=hf.get("mtp_use_dedicated_embeddings", False),
                **{k: hf[k] for k in names})


# Linear layers of the decoder that an FP8 checkpoint stores in e4m3 (the names they have
# there); modules_to_not_convert may not name one: the engine computes them all in FP8.
FP8_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _read_quantization(hf: Mapping[str, Any], path: str | os.PathLike[str]) -> Fp8Config | None:
    """The checkpoint's FP8 format from ``quantization_config``; None without one.

    Raises:
        ValueError: another quant_method or an FP8 format the kernels do not serve
            (``Fp8Config.from_hf``), per-channel scales in a checkpoint, or a decoder linear
            layer listed in ``modules_to_not_convert``.
    """
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, Mapping) else None
    if method != "fp8":
        raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not served (fp8 is)")
    try:
        config = Fp8Config.from_hf(qc)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if config.weight_block_size is None:
        raise ValueError(f"{path}: quantization_config.weight_block_size null (per-channel scales) is not "
                         f"served from a checkpoint; quantization='fp8' quantizes a 16-bit one per channel")
    kept = [m for m in config.modules_to_not_convert if m.split(".")[-1] in FP8_LINEAR_MODULES]
    if kept:
        raise ValueError(f"{path}: quantization_config.modules_to_not_convert keeps decoder linear layers "
                         f"{kept} in 16 bits; the engine serves checkpoints whose every one of them is FP8")
    return config


def _read_experts(hf: Mapping[str, Any], architecture: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The routing fields of Qwen3-MoE, Qwen3.5-MoE and Qwen3-Next (none for a dense
    architecture). ``router_aux_loss_coef`` and ``output_router_logits`` are training-only and
    ignored. Qwen3-Next mixes dense and sparse layers by ``decoder_sparse_step`` and
    ``mlp_only_layers`` as Qwen3-MoE does, with a shared expert on every sparse layer and
    ``norm_topk_prob`` true unless it says otherwise (transformers' defaults); with
    ``num_experts`` 0 every layer is dense.

    Raises:
        ValueError: a missing field, a shared expert outside the hybrids (Qwen2-MoE's), or a
            Qwen3.5-MoE layout other than every layer sparse with renormalised weights.
    """
    if architecture not in MOE_ARCHITECTURES:
        return {}
    if hf.get("shared_expert_intermediate_size") and architecture not in HYBRID_ARCHITECTURES:
        raise ValueError(f"{path}: shared_expert_intermediate_size is set; shared experts are not supported")
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 writes the second name
    fields = {"num_experts": experts, "num_experts_per_tok": hf.get("num_experts_per_tok"),
              "moe_intermediate_size": hf.get("moe_intermediate_size")}
    if architecture == QWEN3_NEXT:
        fields["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size")
    missing = [k for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(f"{path}: config.json lacks required field(s) {missing}")
    if architecture == QWEN3_NEXT and experts == 0:
        return {}
    if architecture in ALL_SPARSE_ARCHITECTURES:
        for key, served in (("norm_topk_prob", True), ("decoder_sparse_step", 1), ("mlp_only_layers", [])):
            if hf.get(key, served) != served:
                raise ValueError(f"{path}: {key} {hf[key]!r} is not served for {architecture} (only {served!r})")
        return dict(fields, norm_topk_prob=True,
                    shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size", 0))
    return dict(fields, norm_topk_prob=bool(hf.get("norm_topk_prob", architecture == QWEN3_NEXT)),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def _read_eos(hf: dict[str, Any], directory: str, path: str) -> int | tuple[int, ...] | None:
    """The end-of-sequence id(s): ``eos_token_id`` of config.json and of generation_config.json
    beside it (either may be one id or a list; vLLM also stops at the generation config's),
    in order, without repeats: an int when there is one, a tuple when several, None when none.

    Raises:
        ValueError: an id that is not a non-negative int.
    """
    found: list[int] = []
    sources = [(path, hf.get("eos_token_id"))]
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            sources.append((gen_path, json.load(f).get("eos_token_id")))
    for source, value in sources:
        for i in ([] if value is None else value if isinstance(value, list) else [value]):
            if not isinstance(i, int) or isinstance(i, bool) or i < 0:
                raise ValueError(f"{source}: eos_token_id must be a non-negative int or a list of them, "
                                 f"got {value!r}")
            if i not in found:
                found.append(i)
    return None if not found else found[0] if len(found) == 1 else tuple(found)


def _refuse_unsupported(hf: Mapping[str, Any], architecture: str, path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError`` for a config.json feature our layers do not implement."""
    if hf.get("use_sliding_window"):
        raise ValueError(f"{path}: use_sliding_window is true; sliding-window attention is not supported")
    if architecture in HYBRID_ARCHITECTURES:
        other = [i for i, kind in enumerate(hf.get("layer_types") or []) if kind not in LAYER_KINDS]
        if other:
            raise ValueError(f"{path}: layer_types has layers {other} of kinds other than {LAYER_KINDS}")
    sliding = [i for i, kind in enumerate(hf.get("layer_types") or []) if kind != "full_attention"]
    if sliding and architecture not in HYBRID_ARCHITECTURES:
        raise ValueError(f"{path}: layer_types has non-full-attention layers {sliding}; "
                         "only full attention is supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias is true; MLP biases are not supported")


def _read_rope(hf: Mapping[str, Any], max_positions: int, path: str | os.PathLike[str],
               hybrid: bool = False) -> tuple[float, Llama3RopeScaling | None, float]:
    """``(rope_theta, scaling, partial_rotary_factor)`` from config.json, written either way::

        published (transformers < 5):  "rope_theta": 500000.0,
                                       "rope_scaling": {"rope_type": "llama3", "factor": 32.0, ...} | null
        transformers 5:                "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                                           "factor": 32.0, ...}

    Both may appear in one file; a key given twice must agree. ``"type"`` is the
    older name of ``"rope_type"``. Without a theta, Hugging Face's default (10000).
    ``hybrid`` (Qwen3.5, Qwen3-Next): partial rotary (``partial_rotary_factor`` in the RoPE dict or
    at the top level; 0.25 when neither says) and the multimodal keys (``_MROPE_KEYS``) are read.

    Raises:
        ValueError: conflicting or unknown keys, per-layer RoPE dicts, a RoPE type we do not
            implement (for a hybrid, any but the default), partial rotary outside the hybrids,
            or an invalid number.
    """
    rope: dict[str, Any] = {}
    top_partial = hf.get("partial_rotary_factor") if hybrid else None
    sources = (("rope_scaling", hf.get("rope_scaling")), ("rope_parameters", hf.get("rope_parameters")),
               ("rope_theta", {"rope_theta": hf["rope_theta"]} if hf.get("rope_theta") is not None else None),
               ("partial_rotary_factor", None if top_partial is None else {"partial_rotary_factor": top_partial}))
    for where, source in sources:
        if source is None:
            continue
        if not isinstance(source, dict) or any(isinstance(v, dict) for v in source.values()):
            raise ValueError(f"{path}: {where} must be a flat dict of RoPE settings "
                             f"(per-layer RoPE is not supported), got {source!r}")
        for key, value in source.items():
            if key in rope and rope[key] != value:
                raise ValueError(f"{path}: RoPE {key} given twice and differently: {rope[key]!r} and {value!r}")
            rope[key] = value
    kind = rope.get("rope_type", rope.get("type", "default"))
    if "type" in rope and rope["type"] != kind:
        raise ValueError(f"{path}: rope type given twice and differently: {rope['type']!r} and {kind!r}")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{path}: rope type {kind!r} is not implemented; supported: {SUPPORTED_ROPE_TYPES}")
    if hybrid and kind != "default":
        raise ValueError(f"{path}: rope type {kind!r} is not implemented for hybrid models (their partial "
                         "RoPE is the default type)")
    allowed = (_ROPE_KEYS | (_LLAMA3_KEYS if kind == "llama3" else frozenset())
               | (_MROPE_KEYS if hybrid else frozenset()))
    unknown = sorted(set(rope) - allowed)
    if unknown:
        raise ValueError(f"{path}: unsupported RoPE setting(s) {unknown} for rope type {kind!r}")
    partial = rope.get("partial_rotary_factor", QWEN3_5_PARTIAL_ROTARY_FACTOR if hybrid else 1.0)
    if partial != 1.0 and not hybrid:
        raise ValueError(f"{path}: partial_rotary_factor {rope['partial_rotary_factor']!r} is not supported")
    _check_real("partial_rotary_factor", partial)
    theta = rope.get("rope_theta", HF_DEFAULT_ROPE_THETA)
    _check_real("rope_theta", theta)
    if kind == "default":
        return float(theta), None, float(partial)
    try:
        scaling = Llama3RopeScaling(
            factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope.get("original_max_position_embeddings", max_positions))
    except KeyError as e:
        raise ValueError(f"{path}: rope type 'llama3' lacks {e.args[0]!r}") from None
    return float(theta), scaling, float(partial)


@dataclass(frozen=True)
class Fp8Config:
    """The FP8 checkpoint format the engine serves: e4m3 weights with 128x128 block scales
    (``weight_block_size`` (128, 128): Qwen3-FP8 checkpoints, ``weight_scale_inv``) or
    per-output-channel scales (None: on-the-fly quantization, ``kernels/fp8.py``),
    activations quantized dynamically per token (and 128-column group with block scales).

    Attributes:
        weight_block_size: (128, 128) or None (see above).
        modules_to_not_convert: modules kept in the checkpoint's dtype (the LM head, MoE
            routers, norms); a name matches an entry equal to it or a dotted prefix of it.
    """

    weight_block_size: tuple[int, int] | None = FP8_WEIGHT_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.weight_block_size not in (None, FP8_WEIGHT_BLOCK):
            raise ValueError(f"weight_block_size must be {list(FP8_WEIGHT_BLOCK)} (the block the FP8 kernels "
                             f"serve) or None (per-channel), got {self.weight_block_size!r}")
        if (not isinstance(self.modules_to_not_convert, tuple)
                or not all(isinstance(m, str) and m for m in self.modules_to_not_convert)):
            raise ValueError(f"modules_to_not_convert must be a tuple of module names, "
                             f"got {self.modules_to_not_convert!r}")

    @property
    def scale_mode(self) -> str:
        """How the weights are scaled: "block" (128x128) or "channel"."""
        return "channel" if self.weight_block_size is None else "block"

    def converts(self, module: str) -> bool:
        """Whether the linear layer ``module`` (e.g. "model.layers.0.mlp.gate") is in fp8."""
        return not any(module == m or module.startswith(m + ".") for m in self.modules_to_not_convert)

    @classmethod
    def from_hf(cls, quantization_config: Mapping[str, object]) -> Fp8Config:
        """Read a ``config.json``'s ``quantization_config``, as Qwen3-FP8 checkpoints give it::

            {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head", ...]}

        ``fmt`` and ``activation_scheme`` may be left out (their only served values are the
        defaults); ``weight_block_size`` may not (readers disagree on what its absence means).

        Raises:
            ValueError: naming the field: an unknown key, another quant_method, a format other
                than e4m3, static activation scales, a block other than [128, 128] or null, or
                modules_to_not_convert not a list of names.
        """
        if not isinstance(quantization_config, Mapping):
            raise ValueError(f"quantization_config must be a mapping, got {type(quantization_config).__name__}")
        known = {"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert"}
        unknown = sorted(set(quantization_config) - known)
        if unknown:
            raise ValueError(f"quantization_config has unknown key(s) {unknown}; known: {sorted(known)}")
        served = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        for key, want in served.items():
            got = quantization_config.get(key, None if key == "quant_method" else want)
            if got != want:
                raise ValueError(f"quantization_config.{key} must be {want!r}, got {got!r}")
        if "weight_block_size" not in quantization_config:
            raise ValueError("quantization_config.weight_block_size is missing: give [128, 128] or null")
        block = quantization_config["weight_block_size"]
        if block is not None and (not isinstance(block, (list, tuple)) or list(block) != list(FP8_WEIGHT_BLOCK)):
            raise ValueError(f"quantization_config.weight_block_size must be {list(FP8_WEIGHT_BLOCK)} or null, got {block!r}")
        skip = quantization_config.get("modules_to_not_convert") or []
        if not isinstance(skip, (list, tuple)):
            raise ValueError(f"quantization_config.modules_to_not_convert must be a list, got {skip!r}")
        return cls(weight_block_size=None if block is None else FP8_WEIGHT_BLOCK, modules_to_not_convert=tuple(skip))
