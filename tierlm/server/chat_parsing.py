"""A chat choice's text as OpenAI's message parts: `reasoning_content` (the reasoning parser), then
`content` and `tool_calls` (the tool parser) out of what is left, incrementally.

`ChatOutputParser.feed(text)` per new piece and `finish()` at the end give `ChatPiece`s, the delta of a
streamed chunk; a whole answer is its pieces joined (`ChatMessageParts`). Tool calls get their ids here.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from tierlm.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from tierlm.server.reasoning_parser import Qwen3ReasoningParser, ReasoningDelta
from tierlm.server.tool_parsers import ParsedDelta, ToolParser


@dataclass
class ChatPiece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ChatMessageParts:
    """A whole answer: its pieces joined."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, piece: ChatPiece) -> None:
        self.reasoning += piece.reasoning
        self.content += piece.content
        for call in piece.tool_calls:
            if call.id is not None:
                self.tool_calls.append(ToolCall(id=call.id, function=FunctionCall(name=call.function.name, arguments="")))
            self.tool_calls[call.index].function.arguments += call.function.arguments or ""


class ChatOutputParser:
    def __init__(self, reasoning: Qwen3ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.num_calls = 0

    def feed(self, text: str) -> ChatPiece:
        split = self.reasoning.feed(text) if self.reasoning else ReasoningDelta(content=text)
        return self._piece(split.reasoning, self.tools.feed(split.content) if self.tools else ParsedDelta(split.content))

    def finish(self) -> ChatPiece:
        split = self.reasoning.finish() if self.reasoning else ReasoningDelta()
        if self.tools is None:
            return ChatPiece(split.reasoning, split.content)
        parsed = self.tools.feed(split.content)
        end = self.tools.finish()
        parsed.content += end.content
        parsed.tool_calls += end.tool_calls
        return self._piece(split.reasoning, parsed)

    def whole(self, text: str) -> ChatMessageParts:
        parts = ChatMessageParts()
        parts.add(self.feed(text))
        parts.add(self.finish())
        return parts

    def _piece(self, reasoning: str, parsed: ParsedDelta) -> ChatPiece:
        calls = []
        for call in parsed.tool_calls:
            if call.name is not None:
                self.num_calls += 1
                calls.append(DeltaToolCall(index=call.index, id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                                           function=DeltaFunctionCall(name=call.name, arguments="")))
            else:
                calls.append(DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments)))
        return ChatPiece(reasoning, parsed.content, calls)
