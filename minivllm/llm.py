"""The user-facing front end: ``LLM(model).generate(prompts)``.

Wires tokenizer, model executor and engine together. Engine options are the
config fields by name; an unknown option is a ``TypeError``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Mapping, Sequence, Union

from minivllm.config import CacheConfig, ExecutorConfig, SchedulerConfig, SpeculativeConfig
from minivllm.engine.grammar import GrammarBackend
from minivllm.engine.llm_engine import LLMEngine, TextStream
from minivllm.engine.observer import EngineObserver
from minivllm.executor.base import freeze_imported_objects
from minivllm.model.hf_config import read_model_config
from minivllm.outputs import RequestOutput, text_token_ids
from minivllm.sampling import RequestOutputKind, SamplingParams, eos_token_set
from minivllm.spec import make_proposer

Prompt = Union[str, Sequence[int]]

_CACHE_KEYS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_KEYS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_EXEC_KEYS = {f.name for f in dataclasses.fields(ExecutorConfig)}
# A step's token budget on CUDA unless given: vLLM's for its offline LLM class on
# H100/H200-class GPUs (docs/tuning.md, "Block size and token budget").
CUDA_MAX_NUM_BATCHED_TOKENS = 16384
# Tokens per KV block on CUDA unless given: blocks of 64 hold whole 64-key tiles, so the
# prefill kernel loads its unmasked K/V tiles by tensor-memory copy (TMA); the price:
# prefix-cache hits come in steps of 64 tokens instead of 16 (same section).
CUDA_BLOCK_SIZE = 64
# Files a Hugging Face tokenizer is built from: a directory holding every file of one of
# these sets has a tokenizer (tokenizer.json: a fast tokenizer; tokenizer.model:
# SentencePiece; vocab.json + merges.txt: byte-level BPE; otherwise the tokenizer config
# beside its class's vocabulary file). A config alone builds an empty tokenizer.
TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
    *(("tokenizer_config.json", vocab) for vocab in
      ("vocab.json", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")),
)
_NO_TOKENIZER_HINT = "pass skip_tokenizer_init=True to run on token ids without one"
# apply_chat_template's own arguments: not template variables that chat_template_kwargs may set.
CHAT_TEMPLATE_OWN_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def resolve_model_path(model: str, weights: bool = True) -> str:
    """A ``.gguf`` file as is; a local directory as is, or the one GGUF file in it when it
    holds no safetensors (``minivllm.model.gguf.find_gguf``); otherwise a Hugging Face hub
    id resolved through its cache (without its safetensors when ``weights`` is False:
    ``load_format="dummy"`` reads none).

    Raises:
        ValueError: a directory with several GGUF files, or not a directory and not
            obtainable (offline and not cached).
    """
    from minivllm.model.gguf import find_gguf, is_gguf_file

    if is_gguf_file(model):
        return model
    if os.path.isdir(model):
        return find_gguf(model) or model
    try:
        from huggingface_hub import snapshot_download
        patterns = ["*.json", "*.txt", "tokenizer.model"] + (["*.safetensors"] if weights else [])
        return snapshot_download(model, allow_patterns=patterns)
    except Exception as e:  # any hub/network failure becomes one clear message
        raise ValueError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub or found in its cache ({type(e).__name__}: {e})") from e


def has_tokenizer_files(path: str) -> bool:
    """Whether directory ``path`` holds one of ``TOKENIZER_FILE_SETS``."""
    return any(all(os.path.isfile(os.path.join(path, f)) for f in files) for files in TOKENIZER_FILE_SETS)


def load_tokenizer(path: str) -> Any:
    """The Hugging Face tokenizer of the checkpoint in directory ``path`` (or of GGUF file
    ``path``: built from its metadata).

    A tokenizer whose every token is a special one (what transformers builds from a
    config without vocabulary files) is refused: it would encode any text to nothing.

    Raises:
        ValueError: no tokenizer files, transformers fails to build the tokenizer from
            them, or it has no vocabulary; the message names ``path`` and says to pass
            ``skip_tokenizer_init=True``.
    """
    from minivllm.model.gguf import is_gguf_file, load_gguf_tokenizer

    if is_gguf_file(path):  # vocabulary, merges, special tokens and chat template are in its metadata
        try:
            return load_gguf_tokenizer(path)
        except ValueError as e:
            raise ValueError(f"{e}; {_NO_TOKENIZER_HINT}") from e
    if not has_tokenizer_files(path):
        wanted = " or ".join("+".join(files) for files in TOKENIZER_FILE_SETS[:3])
        raise ValueError(f"model directory {path!r} has no tokenizer files ({wanted}, or "
                         f"tokenizer_config.json with a vocabulary file); {_NO_TOKENIZER_HINT}")
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, TypeError, KeyError...
        raise ValueError(f"the tokenizer of model directory {path!r} could not be loaded "
                         f"({type(e).__name__}: {e}); {_NO_TOKENIZER_HINT}") from e
    num_special = len(tokenizer.added_tokens_decoder)
    if len(tokenizer) <= num_special:
        raise ValueError(f"the tokenizer of model directory {path!r} has no vocabulary beyond its "
                         f"{num_special} special token(s); {_NO_TOKENIZER_HINT}")
    return tokenizer


class DetokenizingTextStreams:
    """The engine's ``text_streams``: a request's incremental detokenizer from its prompt.

    It holds the tokenizer only. A bound method of the ``LLM`` in its place would make
    the engine and the LLM a reference cycle, which keeps the model (and its device
    memory) alive after ``del llm`` until the garbage collector runs.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, prompt_token_ids: list[int], params: SamplingParams) -> TextStream:
        from minivllm.detokenizer import IncrementalDetokenizer
        return IncrementalDetokenizer(self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids, without special tokens (``SamplingParams.bad_words``)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def _close_executor(executor: object) -> None:
    """Free what ``executor`` holds (model, KV pool, graphs, workers), if it can be closed."""
    close = getattr(executor, "close", None)
    if close is not None:
        close()


def split_engine_options(options: dict[str, Any]) -> tuple[dict, dict, dict]:
    """Sort engine options into cache, scheduler and executor settings.

    Raises:
        TypeError: an option name that nothing uses.
    """
    unknown = sorted(set(options) - _CACHE_KEYS - _SCHED_KEYS - _EXEC_KEYS)
    if unknown:
        raise TypeError(f"unknown engine option(s) {unknown}; valid: "
                        f"{sorted(_CACHE_KEYS | _SCHED_KEYS | _EXEC_KEYS)}")
    pick = lambda keys: {k: v for k, v in options.items() if k in keys}  # noqa: E731
    return pick(_CACHE_KEYS), pick(_SCHED_KEYS), pick(_EXEC_KEYS)


class LLM:
    """Offline inference over a Qwen3 checkpoint.

    Args:
        model: a local HF-format directory or a hub id.
        device: ``auto`` (cuda if available, else cpu), ``cpu``, ``cuda``...
        dtype: ``auto`` (bfloat16 on cuda, float32 on cpu) or a torch dtype name.
        kernels: ``auto`` (our Triton kernels on cuda, the torch references elsewhere),
            ``triton`` or ``torch`` (``ExecutorConfig.kernels``).
        seed: seed of the sampler's generator for unseeded requests.
        skip_tokenizer_init: run without a tokenizer (token-id prompts only,
            ``text`` stays None), for checkpoints that ship none.
        speculative_config: speculative decoding, vLLM's dict (``SpeculativeConfig``), e.g.
            ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}`` or
            ``{"model": DRAFT_DIR, "num_speculative_tokens": 4}`` (a draft model with this
            model's vocabulary, run in the same executor);
            rows without ``logit_bias``, ``allowed_token_ids`` or penalties take drafts
            (``ModelExecutor.verifies_drafts``).
        observer: told of the engine's traffic as it runs (``EngineObserver``); e.g.
            ``minivllm.engine.trace.TraceRecorder(PATH)`` writes a trace in the simulator's format
            that ``python -m sim replay`` (``--plot``) replays without the model, on any
            machine. ``close()`` closes it.
        **options: engine options by config field name: ``CacheConfig``
            (block_size: 64 on CUDA, else the config's 16; num_blocks,
            enable_prefix_caching), ``SchedulerConfig``
            (max_num_seqs, max_num_batched_tokens: 16384 on CUDA, else the config's,
            max_model_len, policy, chunked_prefill, async_scheduling: default on for
            CUDA) and
            ``ExecutorConfig`` (enforce_eager, gpu_memory_utilization,
            tensor_parallel_size: N ranks in N processes, one GPU each on CUDA,
            disable_custom_all_reduce: NCCL for every tensor-parallel all-reduce,
            load_format: "dummy" for random weights, only config.json read).

    Raises:
        TypeError: unknown option. ValueError: a bad option value or model, or a model
            directory without a usable tokenizer (unless ``skip_tokenizer_init``).
    """

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto",
                 kernels: str = "auto", seed: int = 0, skip_tokenizer_init: bool = False,
                 observer: EngineObserver | None = None,
                 speculative_config: SpeculativeConfig | Mapping[str, Any] | None = None, **options: Any) -> None:
        import torch

        from minivllm.executor.model_executor import ModelExecutor

        freeze_imported_objects()  # before the model exists: it stays collectable
        cache_opts, sched_opts, exec_opts = split_engine_options(options)
        if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        executor_config = ExecutorConfig.from_dict(
            {**exec_opts, "device": device, "dtype": dtype, "kernels": kernels, "seed": seed})
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        path = resolve_model_path(model, weights=executor_config.load_format == "auto")
        if speculative_config is not None and speculative_config.model is not None:
            speculative_config = dataclasses.replace(speculative_config, model=resolve_model_path(
                speculative_config.model, weights=executor_config.load_format == "auto"))
        self.model_config = read_model_config(path)
        if speculative_config is not None and speculative_config.method == "mtp":
            from minivllm.model.qwen3_5_mtp import check_mtp_config
            check_mtp_config(self.model_config)  # before any process starts (tensor parallelism)
        sched_opts.setdefault("max_model_len", self.model_config.max_position_embeddings)
        # One step in flight pays where a device runs beside the host.
        cuda = torch.device(device).type == "cuda"
        sched_opts.setdefault("async_scheduling", cuda)
        if cuda:  # vLLM's offline default on H100/H200-class GPUs (its server takes 8192)
            sched_opts.setdefault("max_num_batched_tokens", CUDA_MAX_NUM_BATCHED_TOKENS)
            cache_opts.setdefault("block_size", CUDA_BLOCK_SIZE)
        if sched_opts["max_model_len"] > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {sched_opts['max_model_len']} exceeds the model's "
                             f"max_position_embeddings {self.model_config.max_position_embeddings}")
        self.scheduler_config = SchedulerConfig(**sched_opts)
        cache_config = CacheConfig(**cache_opts)
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(path)
        executor_config = dataclasses.replace(executor_config, device=device)
        if executor_config.tensor_parallel_size > 1:
            from minivllm.executor.distributed import TPExecutor
            executor = TPExecutor(self.model_config, path, self.scheduler_config, cache_config,
                                  executor_config, speculative_config=speculative_config)
        else:
            executor = ModelExecutor(self.model_config, path, self.scheduler_config, cache_config,
                                     executor_config, speculative_config=speculative_config)
        eos = self.model_config.eos_token_id
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        streams = DetokenizingTextStreams(self.tokenizer) if self.tokenizer is not None else None
        try:
            self.engine = LLMEngine(self.scheduler_config, cache_config, executor, eos_token_id=eos,
                                    text_streams=streams, vocab_size=self.model_config.vocab_size,
                                    observer=observer, grammar_backend=self._grammars(executor_config, eos),
                                    proposer=make_proposer(speculative_config))
        except BaseException:  # e.g. too many num_blocks: no LLM owns the executor to close it
            _close_executor(executor)
            raise
        self._next_request = 0
        self._closed = False

    def _grammars(self, config: ExecutorConfig, eos: int | list[int] | None) -> GrammarBackend:
        """xgrammar over the tokenizer, or a backend that says why structured outputs are off."""
        from minivllm.structured import NoGrammars, XGrammarBackend

        vocab = self.model_config.vocab_size
        if self.tokenizer is None:
            return NoGrammars(vocab, "this LLM has no tokenizer (skip_tokenizer_init=True)")
        if config.tensor_parallel_size > 1:
            return NoGrammars(vocab, "tensor_parallel_size > 1 does not apply token masks")
        return XGrammarBackend.for_tokenizer(self.tokenizer, vocab, sorted(eos_token_set(eos)))

    # ---- lifecycle ----------------------------------------------------------

    def close(self) -> None:
        """Close the engine (its observer: a trace being recorded) and the executor (the
        model, KV pool, CUDA graphs, tensor-parallel workers); idempotent. Runs on leaving
        a ``with LLM(...) as llm:`` block; afterwards ``generate()`` raises RuntimeError."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close()
        finally:
            _close_executor(self.engine.executor)

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- generation ---------------------------------------------------------

    def prompt_token_ids(self, i: int, prompt: Prompt) -> list[int]:
        """Prompt ``i`` (text or token ids) as checked token ids: the one prompt check of
        ``generate`` and the server.

        Raises:
            TypeError: neither text nor a list of ints. ValueError: empty, or ids outside
                the vocabulary.
        """
        if isinstance(prompt, str):
            ids = self._require_tokenizer().encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in prompt):
            ids = list(prompt)
        else:
            raise TypeError(f"prompt {i}: expected a string or a list of token ids")
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order with ``text`` decoded
        (a prompt whose params ask for ``n`` completions has n outputs, by ``index``).
        The requests run with ``output_kind`` FINAL_ONLY (only finished ones come back).

        Every prompt is checked before any is queued: a bad one raises
        ``ValueError``/``TypeError`` naming its index, nothing of this call is
        queued, and the engine stays ready for the next call.

        Raises:
            RuntimeError: the LLM is closed.
        """
        if self._closed:
            raise RuntimeError("this LLM is closed (close() was called, or its with-block ended): "
                               "build a new LLM to generate")
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = _final_only(self._params_list(sampling_params, len(prompts)))
        token_ids = [self.prompt_token_ids(i, p) for i, p in enumerate(prompts)]
        rids = [f"req-{self._next_request + i}" for i in range(len(prompts))]
        for i, (rid, ids, p) in enumerate(zip(rids, token_ids, params)):
            try:  # the engine's own admission check, for every prompt before any is queued
                self.engine.validate_request(rid, ids, p)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        self._next_request += len(prompts)
        for rid, ids, p in zip(rids, token_ids, params):
            self.engine.add_request(rid, ids, p)
        ids_of = {rid: i for i, rid in enumerate(rids)}
        results = self._run(sum(p.n for p in params), use_tqdm)
        ordered = sorted(results, key=lambda o: (ids_of[o.request_id], o.index))
        if self.tokenizer is None:
            return ordered
        # Requests with stop strings come back with the engine's text (cut at the stop string).
        return [o if o.text is not None else dataclasses.replace(o, text=self._text(o, p))
                for o, p in zip(ordered, (params[ids_of[o.request_id]] for o in ordered))]

    def _text(self, out: RequestOutput, params: SamplingParams) -> str:
        """The completion's text (``text_token_ids``: an eos or stop token that ended it is not in it)."""
        return self.tokenizer.decode(list(text_token_ids(out.token_ids, out.finish_reason)),
                                     skip_special_tokens=params.skip_special_tokens)

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this LLM was built with skip_tokenizer_init=True: pass token ids")
        return self.tokenizer

    @staticmethod
    def _params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n or not all(isinstance(p, SamplingParams) for p in sp):
            raise ValueError(f"sampling_params: expected one SamplingParams or a list of {n}")
        return sp

    def _run(self, total: int, use_tqdm: bool) -> list[RequestOutput]:
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=total, desc="generate", unit="req", dynamic_ncols=True)
        done: list[RequestOutput] = []
        start, ntok = time.perf_counter(), 0
        while self.engine.has_unfinished_requests():
            finished = [o for o in self.engine.step() if o.finished]
            done.extend(finished)
            if bar is not None and finished:
                ntok += sum(len(o.token_ids) for o in finished)
                bar.set_postfix(tok_s=f"{ntok / (time.perf_counter() - start):.0f}")
                bar.update(len(finished))
        if bar is not None:
            bar.close()
        return done

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the tokenizer's chat
        template (the keyword arguments as for ``chat_prompt_text``)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.chat_prompt_ids(c, tools, chat_template_kwargs, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message)
                   for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_text(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                         chat_template_kwargs: dict[str, Any] | None = None, *,
                         add_generation_prompt: bool = True, continue_final_message: bool = False,
                         chat_template: str | None = None) -> str:
        """``conversation`` through the tokenizer's chat template, ready for the assistant's reply.

        Args:
            tools: OpenAI tool definitions, for the template to describe (``tools``).
            chat_template_kwargs: more template variables, e.g. ``{"enable_thinking": False}``
                for Qwen3.
            add_generation_prompt: end with the template's opening of an assistant turn.
            continue_final_message: leave the final (assistant) message open, for the model to
                continue it (instead of opening a new turn).
            chat_template: a template (Jinja text) to render with instead of the tokenizer's.

        Raises:
            ValueError: ``chat_template_kwargs`` sets one of ``apply_chat_template``'s own
                arguments. jinja2.TemplateError: the template refuses the conversation.
        """
        kwargs = dict(chat_template_kwargs or {})
        clash = sorted(set(kwargs) & CHAT_TEMPLATE_OWN_ARGUMENTS)
        if clash:
            raise ValueError(f"chat_template_kwargs: {clash} are apply_chat_template's own arguments, "
                             "not template variables")
        return self._require_tokenizer().apply_chat_template(
            conversation, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, chat_template=chat_template, **kwargs)

    def chat_prompt_ids(self, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None, **ending: bool) -> list[int]:
        """The token ids of ``chat_prompt_text`` (the template's own special tokens, none added;
        ``ending``: its ``add_generation_prompt`` and ``continue_final_message``)."""
        text = self.chat_prompt_text(conversation, tools, chat_template_kwargs, **ending)
        return self._require_tokenizer().encode(text, add_special_tokens=False)


def _final_only(params: list[SamplingParams]) -> list[SamplingParams]:
    """``params`` with ``output_kind`` FINAL_ONLY: ``generate()`` returns finished requests
    only, so the engine need not build an output per request per step. Equal params map
    to one object (the engine interns them anyway)."""
    done: dict[int, SamplingParams] = {}
    out = []
    for p in params:
        q = done.get(id(p))
        if q is None:
            q = done[id(p)] = (p if p.output_kind is RequestOutputKind.FINAL_ONLY
                               else dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY))
        out.append(q)
    return out
