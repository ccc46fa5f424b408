"""What a chat choice's text becomes with the server's parsers: reasoning, content and
tool calls, for a whole response and for a stream (whose chunks reassemble into it).

The reasoning parser (``reasoning.py``) splits the text first; the tool-call parser
(``tool_calls.py``) reads the content only, as vLLM's server chains them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from minivllm.sampling import StructuredOutputs
from minivllm.server.protocol import (AssistantMessage, ChatCompletionRequest, DeltaFunctionCall,
                                      DeltaMessage, DeltaToolCall, FunctionCall, ServerConfig, ToolCall)
from minivllm.server.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning
from minivllm.server.tool_calls import (ContentDelta, ReasoningMode, ToolCallEvent, ToolCallStart,
                                        ToolCallStream, extract_tool_calls, new_tool_call_id,
                                        tool_choice_constraint)


@dataclass(frozen=True)
class ChatOutputParser:
    """How one chat request's choices are parsed.

    Attributes:
        reasoning: split ``<think>`` reasoning from the content.
        in_reasoning: the prompt opened ``<think>`` (the output starts in the reasoning).
        reasoning_mode: where a grammar lets the model reason first (``tool_calls.ReasoningMode``).
        tool_calls: read Hermes tool calls from the content.
        parallel_tool_calls: report every call (else the first only).
        constraint: the grammar that ``tool_choice`` ``required`` or a named function
            puts on the output, or None.
    """

    reasoning: bool
    in_reasoning: bool
    reasoning_mode: ReasoningMode
    tool_calls: bool
    parallel_tool_calls: bool
    constraint: StructuredOutputs | None

    def message(self, index: int, text: str) -> tuple[AssistantMessage, bool]:
        """Choice ``index``'s whole text as the reply; and whether it called a tool."""
        reasoning, content = None, text or None
        if self.reasoning:
            split = split_reasoning(text, self.in_reasoning)
            reasoning, content = split.reasoning_content, split.content
        if not self.tool_calls:
            return AssistantMessage(content=content, reasoning_content=reasoning), False
        found = extract_tool_calls(content or "", new_tool_call_id, self.parallel_tool_calls)
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in found.tool_calls]
        return AssistantMessage(content=found.content, reasoning_content=reasoning,
                                tool_calls=calls or None), bool(calls)

    def stream(self, index: int) -> "ChoiceStream":
        """A parser for choice ``index``'s streamed text."""
        return ChoiceStream(self, new_tool_call_id)


class ChoiceStream:
    """One streamed choice: fed its text deltas, it returns the chunks' deltas, in order."""

    def __init__(self, parser: ChatOutputParser, new_id: Callable[[], str]) -> None:
        self._reasoning = ReasoningStream(parser.in_reasoning) if parser.reasoning else None
        self._tools = ToolCallStream(new_id, parser.parallel_tool_calls) if parser.tool_calls else None
        self.called = False  # a tool call was sent

    def feed(self, text: str) -> list[DeltaMessage]:
        """The deltas that ``text`` (the choice's next text) decides."""
        if self._reasoning is None:
            return self._content(text)
        split = self._reasoning.feed(text)
        return self._thought(split.reasoning_content) + self._content(split.content)

    def finish(self) -> list[DeltaMessage]:
        """The held-back rest, at the end of the choice."""
        out: list[DeltaMessage] = []
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out = self._thought(split.reasoning_content) + self._content(split.content)
        if self._tools is not None:
            out += self._events(self._tools.finish())
        return out

    @staticmethod
    def _thought(text: str) -> list[DeltaMessage]:
        return [DeltaMessage(reasoning_content=text)] if text else []

    def _content(self, text: str) -> list[DeltaMessage]:
        if self._tools is None:
            return [DeltaMessage(content=text)] if text else []
        return self._events(self._tools.feed(text))

    def _events(self, events: list[ToolCallEvent]) -> list[DeltaMessage]:
        out = []
        for e in events:
            if isinstance(e, ContentDelta):
                out.append(DeltaMessage(content=e.text))
            elif isinstance(e, ToolCallStart):
                self.called = True
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=e.index, id=e.id, type="function", function=DeltaFunctionCall(name=e.name, arguments=""))]))
            else:
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=e.index, function=DeltaFunctionCall(arguments=e.arguments))]))
        return out


def chat_output_parser(config: ServerConfig, req: ChatCompletionRequest, opening: str) -> ChatOutputParser | None:
    """How ``req``'s choices are parsed on a server with ``config``, given the prompt's
    ``opening`` of the reply (what the template added after the conversation, or the
    continued final message: ``_Server.chat_prompt``); None when nothing is parsed (the
    text is the content).

    Tool calls are parsed when the request gives tools and ``tool_choice`` is not
    ``none``: for ``auto`` with the server's Hermes parser; for ``required`` or a named
    function always, since their grammar makes the model write Hermes calls.

    Raises:
        ValueError: ``tool_choice`` ``auto`` on a server without a tool-call parser (as
            vLLM refuses it), or a tool whose ``parameters`` cannot become a grammar.
    """
    choice = req.effective_tool_choice()
    if choice == "auto" and config.tool_call_parser is None:
        raise ValueError("tool_choice: 'auto' needs a server started with --tool-call-parser hermes "
                         "(send tool_choice 'none' to give the tools to the prompt only)")
    reasoning = config.reasoning_parser is not None
    in_reasoning = reasoning and prompt_opens_reasoning(opening)
    mode: ReasoningMode = "none" if not reasoning else "open" if in_reasoning else "optional"
    constraint = tool_choice_constraint(req.template_tools() or [], choice, req.parallel_tool_calls, mode)
    tools = choice != "none"
    if not reasoning and not tools:
        return None
    return ChatOutputParser(reasoning=reasoning, in_reasoning=in_reasoning, reasoning_mode=mode, tool_calls=tools,
                            parallel_tool_calls=req.parallel_tool_calls, constraint=constraint)
