"""Command line: ``python -m minivllm generate --model DIR "prompt" ...``,
``python -m minivllm serve DIR [--host 127.0.0.1] [--port 8000]`` or
``python -m minivllm chat MODEL`` (a conversation on stdin and stdout)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from minivllm import envs
from minivllm.config import KERNEL_CHOICES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from minivllm.sampling import MAX_LOGPROBS

if TYPE_CHECKING:
    from minivllm.llm import LLM
    from minivllm.sampling import SamplingParams


SERVE_MAX_NUM_BATCHED_TOKENS = 8192
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")

logger = logging.getLogger("minivllm.cli")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minivllm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete prompts and print each completion",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("prompts", nargs="+", help="prompt texts")
    g.add_argument("--model", required=True, help="HF-format model directory or hub id")
    g.add_argument("--temperature", type=float, default=0.0, help="below 1e-5 = greedy")
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true")
    _add_engine_args(g)
    g.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    s = sub.add_parser("serve", help="serve the OpenAI API over HTTP (needs the 'serve' extra)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("model", help="HF-format model directory or hub id")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model names clients may send (default: the model argument); responses "
                        "and metrics carry the first")
    s.add_argument("--chat-template", default=None,
                   help="the chat template to use instead of the tokenizer's: a file, or the "
                        "template's text")
    s.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request send its own chat_template (refused otherwise, as vLLM)")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in replies (the prefix cache's hits)")
    s.add_argument("--seed", type=int, default=0, help="sampler seed for unseeded requests")
    # The env var is read in _serve, not here: a default would be printed by --help.
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (/health and "
                        "/metrics stay open) (else $MINIVLLM_API_KEY if set; neither: no key)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, as vLLM does (the HTTP loop and the "
                        "engine stop sharing one GIL; docs/tuning.md, 'Host path')")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body; a larger one is answered 413")
    s.add_argument("--reasoning-parser", default=None, choices=["qwen3"],
                   help="split <think>...</think> out of chat replies as reasoning_content")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes"],
                   help="turn <tool_call> blocks of chat replies into tool_calls (tool_choice auto)")
    s.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                   help="log level of the HTTP server (uvicorn)")
    _add_vllm_serve_args(s)
    _add_engine_args(s)
    c = sub.add_parser("chat", help="chat on stdin/stdout: each line is a user turn, the reply "
                                    "streams back; EOF or /exit ends it",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c.add_argument("model", help="HF-format model directory, hub id or .gguf file")
    c.add_argument("--system", default=None, help="system message opening the conversation")
    c.add_argument("--temperature", type=float, default=0.0, help="below 1e-5 = greedy")
    c.add_argument("--top-p", type=float, default=1.0)
    c.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    c.add_argument("--seed", type=int, default=None, help="sampling seed of every reply")
    _add_engine_args(c)
    return p


def _add_vllm_serve_args(p: argparse.ArgumentParser) -> None:
    """vLLM's serve flags that scripts copy from a ``vllm serve`` line: accepted, so that the
    line runs here; ``_check_vllm_flags`` says which change nothing."""
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto; needs --tool-call-parser, which alone "
                        "enables it here")
    p.add_argument("--max-logprobs", type=int, default=None,
                   help=f"vLLM's cap on top logprobs per token; fixed at {MAX_LOGPROBS} here")
    p.add_argument("--generation-config", default=None,
                   help="vLLM's source of sampling defaults; none here (a request's own, else "
                        "vLLM's); the model's generation_config.json gives its eos ids only")
    p.add_argument("--tokenizer", default=None, help="vLLM's tokenizer path; the model's is used here")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="vLLM's permission to run a checkpoint's code; none is run here")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's switch; requests are not logged here")


def _ineffective_vllm_flags(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, why it changes nothing here) for each such vLLM flag given."""
    ineffective = []
    if args.max_logprobs is not None and args.max_logprobs != MAX_LOGPROBS:
        ineffective.append(("--max-logprobs", f"a request may ask for at most {MAX_LOGPROBS} top logprobs"))
    if args.generation_config is not None:
        ineffective.append(("--generation-config", "sampling defaults are a request's own, else vLLM's; the "
                                                   "model's generation_config.json is read for its eos ids only"))
    if args.tokenizer is not None and args.tokenizer != args.model:
        ineffective.append(("--tokenizer", "the tokenizer is the model's own"))
    if args.trust_remote_code:
        ineffective.append(("--trust-remote-code", "no code of a checkpoint is ever run"))
    if args.disable_log_requests:
        ineffective.append(("--disable-log-requests", "requests are not logged"))
    return ineffective


def _check_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse what vLLM refuses; log one warning per vLLM flag given that changes nothing here.

    Raises:
        ValueError: --enable-auto-tool-choice without --tool-call-parser.
    """
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (as in vLLM)")
    for flag, why in _ineffective_vllm_flags(args):
        logger.warning("%s has no effect here: %s", flag, why)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options that build the ``LLM`` (shared by generate and serve)."""
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kernels", default="auto", choices=KERNEL_CHOICES,
                   help="our Triton kernels or the torch references for every op (auto: Triton on CUDA)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 16384 on CUDA for generate, 8192 to "
                        "serve, as vLLM)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the GPU's memory the model and KV pool may use (CUDA)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of prompt prefixes computed before (off: every prompt "
                        "computed in full)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (processes; one GPU each on CUDA) the model is split over")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="with --tensor-parallel-size > 1 on CUDA: every all-reduce through NCCL")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="fp8: the KV cache in e4m3 (per-layer scales), twice the tokens in the same memory")
    p.add_argument("--quantization", default=None, choices=[q for q in QUANTIZATIONS if q],
                   help="fp8: a 16-bit checkpoint's linear layers in e4m3 with per-channel scales "
                        "(an FP8 checkpoint is read as it is)")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights, only config.json read (no weight files needed)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3}')
    p.add_argument("--record-trace", default=None, metavar="FILE.jsonl",
                   help="write the engine's traffic as a trace that python -m sim replay replays")


def _engine_options(args: argparse.Namespace, seed: int = 0) -> dict[str, object]:
    """The ``LLM`` options of the engine arguments; ``seed``: the LLM's sampler seed (a
    recorded trace's header names it)."""
    opts = {k: v for k, v in dict(block_size=args.block_size, num_blocks=args.num_blocks,
                                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  gpu_memory_utilization=args.gpu_memory_utilization).items()
            if v is not None}
    if not args.enable_prefix_caching:
        opts["enable_prefix_caching"] = False
    if args.enforce_eager:
        opts["enforce_eager"] = True
    if args.tensor_parallel_size != 1:
        opts["tensor_parallel_size"] = args.tensor_parallel_size
    if args.disable_custom_all_reduce:
        opts["disable_custom_all_reduce"] = True
    if args.load_format != "auto":
        opts["load_format"] = args.load_format
    if args.kv_cache_dtype != "auto":
        opts["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization is not None:
        opts["quantization"] = args.quantization
    if args.speculative_config is not None:
        try:
            opts["speculative_config"] = json.loads(args.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(opts["speculative_config"], dict):
            raise ValueError("--speculative-config must be a JSON object")
    if args.record_trace is not None:
        from minivllm.engine.trace import TraceRecorder
        opts["observer"] = TraceRecorder(args.record_trace, seed=seed)
    return opts


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "chat":
        return _chat(args)
    from minivllm.llm import LLM
    from minivllm.sampling import SamplingParams

    try:
        opts = _engine_options(args)  # --seed is each request's here, not the LLM's
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        with LLM(args.model, device=args.device, dtype=args.dtype,
                 kernels=args.kernels, **opts) as llm:
            if args.chat:
                outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                                use_tqdm=False)
            else:
                outs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outs):
        print(f"{prompt!r} -> {out.text!r}  [{out.finish_reason}, {len(out.token_ids)} tokens]")
    return 0


CHAT_EXIT = "/exit"


def _chat(args: argparse.Namespace) -> int:
    from minivllm.llm import LLM
    from minivllm.sampling import RequestOutputKind, SamplingParams
    from minivllm.server.engine_process import size_torch_threads

    # One process whose main thread detokenizes and writes beside torch's threads, as the
    # server's engine process beside its server process: sized the same way.
    size_torch_threads()
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                                seed=args.seed, output_kind=RequestOutputKind.DELTA)
        llm = LLM(args.model, device=args.device, dtype=args.dtype, kernels=args.kernels,
                  **_engine_options(args))
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with llm:
        chat_loop(llm, params, sys.stdin, sys.stdout, system=args.system)
    return 0


def chat_loop(llm: "LLM", params: "SamplingParams", stdin: TextIO, stdout: TextIO,
              system: str | None = None) -> None:
    """Read user turns from ``stdin`` until EOF or ``/exit``; stream each reply to ``stdout``.

    Each reply is generated for the whole conversation so far (through the tokenizer's
    chat template) and joins it. A turn the engine refuses (e.g. the conversation has
    outgrown ``max_model_len``) is reported on stderr and left out of the conversation.
    """
    conversation = [{"role": "system", "content": system}] if system else []
    prompt = "> " if stdin.isatty() else ""
    for turn in itertools.count():
        stdout.write(prompt)
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == CHAT_EXIT:
            return
        if not line.strip():
            continue
        asked = conversation + [{"role": "user", "content": line.rstrip("\n")}]
        try:
            reply = _stream_reply(llm, llm.chat_prompt_ids(asked), params, f"chat-{turn}", stdout)
        except (ValueError, TypeError) as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        conversation = asked + [{"role": "assistant", "content": reply}]


def _stream_reply(llm: "LLM", prompt_ids: list[int], params: "SamplingParams", request_id: str,
                  out: TextIO) -> str:
    """Generate one reply, writing its text to ``out`` as each token arrives; the reply.

    ``params.max_tokens`` is cut to the room the conversation leaves in ``max_model_len``,
    so a long conversation still gets a (shorter) reply.
    """
    from minivllm.detokenizer import IncrementalDetokenizer

    room = llm.scheduler_config.max_model_len - len(prompt_ids)
    if 0 < room < params.max_tokens:
        params = dataclasses.replace(params, max_tokens=room)
    text = IncrementalDetokenizer(llm.tokenizer, prompt_ids, skip_special_tokens=True)
    llm.engine.add_request(request_id, prompt_ids, params)
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            out.write(text.add(output.new_token_ids))
            out.flush()
    out.write(text.flush() + "\n")
    out.flush()
    return text.text


def _chat_template(value: str | None) -> str | None:
    """``--chat-template``: the text of the file it names, or (no such file) the template's
    own text, as vLLM reads it.

    Raises:
        ValueError: a value that looks like a file name (no Jinja in it) but names no file.
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" not in value and "{%" not in value:
        raise ValueError(f"--chat-template: no file {value!r}, and it is no template either (no {{{{ or {{%)")
    return value


def _serve(args: argparse.Namespace) -> int:
    try:
        from minivllm.server.app import build_app, serve
        from minivllm.server.engine_loop import AsyncEngine
        from minivllm.server.metrics import ServerMetrics
        from minivllm.server.protocol import ServerConfig
    except ImportError as e:
        print(f"error: serving needs the 'serve' extra (pip install -e '.[serve]'): {e}",
              file=sys.stderr)
        return 2
    from minivllm.llm import LLM

    try:
        _check_vllm_flags(args)
        names = args.served_model_name or [args.model]
        config = ServerConfig(model_name=names[0], aliases=tuple(names[1:]),
                              api_key=args.api_key or envs.api_key(),
                              max_body_bytes=args.max_body_bytes,
                              reasoning_parser=args.reasoning_parser,
                              tool_call_parser=args.tool_call_parser,
                              chat_template=_chat_template(args.chat_template),
                              trust_request_chat_template=args.trust_request_chat_template,
                              enable_prompt_tokens_details=args.enable_prompt_tokens_details)
        llm_options = dict(device=args.device, dtype=args.dtype, kernels=args.kernels,
                           seed=args.seed, **_engine_options(args, args.seed))
        # vLLM's server budget (its offline LLM takes 16384, as ours does on CUDA): a
        # smaller step keeps the streams' inter-token latency down while prompts arrive.
        llm_options.setdefault("max_num_batched_tokens", SERVE_MAX_NUM_BATCHED_TOKENS)
        metrics = ServerMetrics(config.model_name)
        if args.engine_process:
            from minivllm.server.engine_process import LLMFront, ProcessAsyncEngine

            front = LLMFront(args.model)
            engine = ProcessAsyncEngine(args.model, llm_options, front.tokenizer, metrics)
        else:
            llm = LLM(args.model, **llm_options)  # type: ignore[arg-type]
            engine = AsyncEngine.from_llm(llm, metrics)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # 1 when the server stopped because its engine failed (app.serve).
    if args.engine_process:  # the app's lifespan stops the engine process
        return serve(build_app(front, config, engine), args.host, args.port, args.uvicorn_log_level)
    with llm:
        return serve(build_app(llm, config, engine), args.host, args.port, args.uvicorn_log_level)


if __name__ == "__main__":
    sys.exit(main())
