"""A server over the real engine whose "model" is scripted: for each prompt the executor writes
the completion a script gives (then eos), token by token, through the real engine, its
detokenizer and the server. The tokenizer and chat template are the Qwen3-format fixture
(``fixtures/qwen3-chat-tokenizer``), so the completions hold Qwen3's real tags as single
tokens, and the prompts the executor records show what the template rendered."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from minivllm.config import CacheConfig, SchedulerConfig
from minivllm.engine.grammar import allowed_tokens
from minivllm.engine.llm_engine import LLMEngine
from minivllm.engine.plan import StepPlan, StepResult
from minivllm.llm import DetokenizingTextStreams
from minivllm.server.app import build_app
from minivllm.server.engine_loop import AsyncEngine
from minivllm.server.engine_process import LLMFront
from minivllm.server.protocol import ServerConfig
from minivllm.structured import XGrammarBackend
from tests.server.utils import served

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "fixtures" / "qwen3-chat-tokenizer"
TIMEOUT = 20.0  # seconds: every wait of these servers is bounded
VOCAB_SIZE = 512  # the fixture's 509 tokens, padded as checkpoints pad their embeddings
EOS = 502  # <|im_end|>


def call(name: str, arguments: dict) -> str:
    """A Hermes tool call as Qwen3 writes it."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


def last_user_turn(prompt: str) -> str:
    """The text of the rendered prompt's last user turn (what a script keys on)."""
    return prompt.rsplit("<|im_start|>user\n", 1)[-1]


def script_of(replies: Mapping[str, str], plain: str) -> Callable[[str], str]:
    """A script: the reply of the first key found in the prompt's last user turn, else ``plain``."""
    def script(prompt: str) -> str:
        turn = last_user_turn(prompt)
        return next((reply for key, reply in replies.items() if key in turn), plain)
    return script


class ScriptedExecutor:
    """An executor whose "model" writes ``script(prompt text)`` and then eos.

    It keeps what each sequence was fed (its KV cache, in effect) and records every prompt
    it sampled from, decoded with the special tokens. Under a grammar's mask a scripted
    token the mask forbids is recorded in ``refused`` and replaced by the first allowed
    one. Prefix caching must be off (a sequence must be fed its whole prompt) and
    preemption must not happen.
    """

    def __init__(self, tokenizer: Any, script: Callable[[str], str], num_blocks: int) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.num_blocks = num_blocks
        self.prompts: list[str] = []
        self.refused: list[int] = []
        self._fed: dict[int, list[int]] = {}
        self._replies: dict[int, tuple[int, list[int]]] = {}  # seq id -> (prompt length, reply)

    def num_kv_blocks(self) -> int:
        return self.num_blocks

    def state_pool(self) -> tuple[int, int]:
        return 0, 0

    def run(self, plan: StepPlan, bitmask: np.ndarray | None) -> StepResult:
        sampled, offset, sampling_row = {}, 0, 0
        for row, seq_id in enumerate(plan.seq_ids):
            n, start = int(plan.query_lens[row]), int(plan.start_positions[row])
            fed = self._fed.setdefault(seq_id, [])
            assert len(fed) == start, "fed out of order (prefix hit or preemption)"
            fed.extend(plan.token_ids[offset:offset + n].tolist())
            offset += n
            if not plan.sample[row]:
                continue
            token = self._next_token(seq_id, fed)
            if len(plan.masked) and plan.masked[row]:
                assert bitmask is not None
                allowed = allowed_tokens(bitmask[sampling_row], VOCAB_SIZE)
                if token not in allowed:
                    self.refused.append(token)
                    token = int(allowed[0])
            sampled[seq_id] = token
            sampling_row += 1
        return StepResult(sampled=sampled)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.run(plan, None)

    def _next_token(self, seq_id: int, fed: list[int]) -> int:
        if seq_id not in self._replies:
            prompt = self.tokenizer.decode(fed, skip_special_tokens=False)
            self.prompts.append(prompt)
            reply = self.tokenizer.encode(self.script(prompt), add_special_tokens=False) + [EOS]
            self._replies[seq_id] = (len(fed), reply)
        prompt_len, reply = self._replies[seq_id]
        return reply[min(len(fed) - prompt_len, len(reply) - 1)]

    def submit(self, plan: StepPlan) -> "ScriptedStep":
        return ScriptedStep(self, plan)


class ScriptedStep:
    """A submitted step: it samples when its result is asked for, after its bitmask."""

    def __init__(self, executor: ScriptedExecutor, plan: StepPlan) -> None:
        self.executor, self.plan = executor, plan
        self.bitmask: np.ndarray | None = None

    def set_token_bitmask(self, bitmask: np.ndarray) -> None:
        self.bitmask = bitmask

    def result(self) -> StepResult:
        return self.executor.run(self.plan, self.bitmask)


def write_model_dir(path: Path) -> Path:
    """``path`` as a checkpoint directory without weights: the fixture tokenizer and a config.json."""
    for f in TOKENIZER.iterdir():
        shutil.copy(f, path / f.name)
    config = json.loads((ROOT / "fixtures" / "tiny-qwen3" / "config.json").read_text())
    config.update(vocab_size=VOCAB_SIZE, eos_token_id=EOS, bos_token_id=None, pad_token_id=500,
                  max_position_embeddings=4096)
    (path / "config.json").write_text(json.dumps(config))
    return path


def start_server(model_dir: Path, config: ServerConfig, script: Callable[[str], str]
                 ) -> tuple[Any, ScriptedExecutor, Callable[[], None]]:
    """The app over an engine scripted by ``script`` (prompt text -> completion), served by
    uvicorn on 127.0.0.1 (port 0): (base URL, the executor, stop)."""
    front = LLMFront(str(model_dir))
    executor = ScriptedExecutor(front.tokenizer, script, num_blocks=256)
    engine = LLMEngine(SchedulerConfig(max_model_len=4096, max_num_seqs=8),
                       CacheConfig(block_size=16, num_blocks=256, enable_prefix_caching=False),
                       executor, eos_token_id=EOS, vocab_size=VOCAB_SIZE,
                       text_streams=DetokenizingTextStreams(front.tokenizer),
                       grammar_backend=XGrammarBackend.for_tokenizer(front.tokenizer, VOCAB_SIZE, [EOS]))
    app = build_app(front, config, AsyncEngine(engine, front.tokenizer))
    stack = contextlib.ExitStack()
    url, _ = stack.enter_context(served(app, TIMEOUT))
    return url, executor, stack.close
