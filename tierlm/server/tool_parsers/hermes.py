"""`hermes`: calls as JSON in tags, `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` (Qwen 2.5 / 3).

Arguments stream as the model writes them: everything after `"arguments":` except a trailing run of `}`
and whitespace, which may be the object's own closing brace (the final text drops exactly one `}`). A
block that does not start with "name" then "arguments" is read whole at its end, as JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tierlm.engine.structured_output import bounded_strings_as_patterns
from tierlm.server.tool_parsers.base import ToolParser

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TRAILING = "} \t\r\n"


class HermesToolParser(ToolParser):
    name = "hermes"

    def read_block(self, body: str, final: bool) -> tuple[str, str] | None:
        head = _HEAD.match(body)
        if head is not None:
            name, rest = json.loads(head[1]), body[head.end() :]
            if not final:
                return name, rest.rstrip(_TRAILING)
            rest = rest.rstrip()
            return name, rest[:-1].rstrip() if rest.endswith("}") else rest
        if not final:
            return None
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        return call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)

    @classmethod
    def call_tag(cls, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag", "begin": f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": ',
            # the tag's vocabulary has newline tokens: length-bounded strings must not take one raw
            "content": {"type": "json_schema", "json_schema": bounded_strings_as_patterns(parameters),
                        "max_whitespace_cnt": 1},
            "end": "}\n</tool_call>",
        }
