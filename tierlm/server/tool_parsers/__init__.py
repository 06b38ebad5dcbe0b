"""Tool-call parsers: model text -> OpenAI `tool_calls`, one module per format, chosen by
`--tool-call-parser NAME` (see `base.ToolParser` for the contract)."""

from __future__ import annotations

from tierlm.server.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser
from tierlm.server.tool_parsers.hermes import HermesToolParser
from tierlm.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Qwen3CoderToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCallDelta", "ToolParser"]
