"""What every tool-call parser shares: splitting model text into content and `<tool_call>` blocks,
incrementally, and turning each block into a call's name and arguments as they arrive.

A parser instance follows one choice's text: `feed(text)` with each new piece, `finish()` at the end; each
returns a `ParsedDelta` (new content, and tool-call deltas in OpenAI's streaming shape: a call's first
delta has its name, later ones fragments of its arguments). A non-streamed answer is the same calls
joined, so streamed and whole answers always agree. Text that may still become a tag is held back until
it is decided. A block whose call cannot be read (no name) is given back as content, tags included.
`max_calls=1` (the request's `parallel_tool_calls: false` under tool_choice "auto") keeps the first call:
every `<tool_call>` block after it is dropped whole (neither a call nor content); the text around it stays.

A subclass knows its format: `read_block(body, final)` gives (name, arguments so far) of a block's body
(None while its name is not known); the arguments of a longer body must extend those of a shorter one.
`structural_tag(...)` is the xgrammar structural tag that forces calls in the format (tool_choice
"required" or a named function).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

START, END = "<tool_call>", "</tool_call>"


@dataclass
class ToolCallDelta:
    index: int  # the call's place among this choice's calls
    name: str | None = None  # only on a call's first delta
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add_arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == index and last.name is None:  # a call's first delta stays alone
            last.arguments += text
        else:
            self.tool_calls.append(ToolCallDelta(index, arguments=text))


def held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is the start of `tag` (it may still become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def parameter_schemas(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{function name: its parameters' JSON schema} of OpenAI-shaped tools."""
    return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}


class ToolParser(ABC):
    name: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]], max_calls: int | None = None) -> None:
        self.schemas = parameter_schemas(tools)
        self.max_calls = max_calls
        self._buffer = ""
        self._in_block = False
        self._calls = 0  # calls started so far
        self._started = False  # the open block's call has been announced
        self._sent = 0  # characters of the open call's arguments already sent
        self._after_call = False  # whitespace here separates calls: it is not content
        self._dropping = False  # the open block comes after max_calls calls: it is dropped

    @abstractmethod
    def read_block(self, body: str, final: bool) -> tuple[str, str] | None:
        """(name, arguments text so far) of a block body, or None while (or if) no call can be read."""

    @classmethod
    @abstractmethod
    def call_tag(cls, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """The structural-tag `tag` format of one call of function `name` (its `<tool_call>` block)."""

    @classmethod
    def structural_tag(cls, tools: list[dict[str, Any]], parallel: bool) -> str:
        """An xgrammar structural tag (JSON text): one or more calls of these tools and nothing else (one
        call only unless `parallel`)."""
        tags = [cls.call_tag(name, schema) for name, schema in parameter_schemas(tools).items()]
        return json.dumps({"type": "structural_tag", "format": {
            "type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": not parallel,
        }})

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        out = ParsedDelta()
        while True:
            if not self._in_block:
                if self._after_call:
                    self._buffer = self._buffer.lstrip()
                    self._after_call = not self._buffer
                at = self._buffer.find(START)
                if at == -1:
                    keep = held_back(self._buffer, START)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.content += self._buffer[:at]
                self._buffer = self._buffer[at + len(START) :]
                self._in_block, self._started, self._sent = True, False, 0
                self._dropping = self.max_calls is not None and self._calls >= self.max_calls
            else:
                at = self._buffer.find(END)
                if self._dropping:
                    if at == -1:
                        self._buffer = self._buffer[len(self._buffer) - held_back(self._buffer, END) :]
                        return out
                    self._buffer = self._buffer[at + len(END) :]
                    self._in_block, self._after_call = False, True
                    continue
                if at == -1:
                    body = self._buffer[: len(self._buffer) - held_back(self._buffer, END)]
                    self._progress(body, False, out)
                    return out
                body, self._buffer = self._buffer[:at], self._buffer[at + len(END) :]
                self._close(body, out, START + body + END)

    def finish(self) -> ParsedDelta:
        """The end of the text: held-back content, and the last call if its block was left open."""
        out = ParsedDelta()
        if self._in_block and not self._dropping:
            self._close(self._buffer, out, START + self._buffer)
        elif not self._in_block:
            out.content = self._buffer
        self._buffer = ""
        return out

    def _progress(self, body: str, final: bool, out: ParsedDelta) -> bool:
        read = self.read_block(body, final)
        if read is None:
            return False
        name, arguments = read
        if not self._started:
            self._started = self._after_call = True
            out.tool_calls.append(ToolCallDelta(self._calls, name=name))
            self._calls += 1
        out.add_arguments(self._calls - 1, arguments[self._sent :])
        self._sent = len(arguments)
        return True

    def _close(self, body: str, out: ParsedDelta, raw: str) -> None:
        self._in_block = False
        if not self._progress(body, True, out) and not self._started:
            out.content += raw  # not a call after all
