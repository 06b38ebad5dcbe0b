"""Reasoning parsers: split a thinking model's text into `reasoning_content` and `content`, incrementally,
chosen by `--reasoning-parser NAME`.

`qwen3`: reasoning is a `<think>...</think>` block. It is open from the first token when the prompt
opened it (a template that ends its generation prompt with `<think>`), or when the output starts with
`<think>`; otherwise the whole output is content. Reasoning ends at `</think>`, and the whitespace right
after it is dropped; a reasoning block the output never closes (cut by max_tokens) is all reasoning. A
streamed answer and a whole one split identically: both feed the same state machine, which holds back
text that may still be a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierlm.server.tool_parsers.base import held_back


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class Qwen3ReasoningParser:
    name = "qwen3"
    start_tag, end_tag = "<think>", "</think>"

    def __init__(self, prompt_text: str | None) -> None:
        self._phase = "reasoning" if self.prompt_opens_reasoning(prompt_text) else "start"
        self._buffer = ""

    @classmethod
    def prompt_opens_reasoning(cls, prompt_text: str | None) -> bool:
        """The prompt ends inside a reasoning block (its generation prompt opened one)."""
        return bool(prompt_text) and prompt_text.rstrip().endswith(cls.start_tag)

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        out = ReasoningDelta()
        while self._buffer:
            if self._phase == "start":
                if self._buffer.startswith(self.start_tag):
                    self._buffer, self._phase = self._buffer[len(self.start_tag) :], "reasoning"
                elif self.start_tag.startswith(self._buffer):
                    return out  # may still be the tag
                else:
                    self._phase = "content"
            elif self._phase == "reasoning":
                at = self._buffer.find(self.end_tag)
                if at == -1:
                    keep = held_back(self._buffer, self.end_tag)
                    out.reasoning += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
                out.reasoning += self._buffer[:at]
                self._buffer, self._phase = self._buffer[at + len(self.end_tag) :], "after"
            elif self._phase == "after":
                self._buffer = self._buffer.lstrip()
                if self._buffer:
                    self._phase = "content"
            else:
                out.content, self._buffer = out.content + self._buffer, ""
        return out

    def finish(self) -> ReasoningDelta:
        """The held-back end: a partial tag is text of the phase it stands in."""
        rest, self._buffer = self._buffer, ""
        if self._phase == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content="" if self._phase == "after" else rest)


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {Qwen3ReasoningParser.name: Qwen3ReasoningParser}
