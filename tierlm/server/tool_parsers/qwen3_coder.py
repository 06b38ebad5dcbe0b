"""`qwen3_coder`: calls as XML-like blocks (Qwen3-Coder), one parameter per element:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text; each becomes JSON by its parameter's schema type (a string stays text; integer,
number, boolean, object and array values are parsed, and kept as text if they do not parse). One
newline around a value is the format's, not the value's. Arguments stream as a JSON object: `{` once the
function is named, each parameter once its `</parameter>` arrives, `}` at `</function>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tierlm.engine.structured_output import arrays_with_items
from tierlm.server.tool_parsers.base import ToolParser

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def read_block(self, body: str, final: bool) -> tuple[str, str] | None:
        function = _FUNCTION.match(body)
        if function is None:
            return None
        name = function[1].strip()
        properties = self.schemas.get(name, {}).get("properties") or {}
        rest = body[function.end() :]
        items = [
            f"{json.dumps(key.strip())}: {json.dumps(_value(value, properties.get(key.strip())), ensure_ascii=False)}"
            for key, value in _PARAMETER.findall(rest)
        ]
        closed = final or "</function>" in rest
        return name, "{" + ", ".join(items) + ("}" if closed else "")

    @classmethod
    def call_tag(cls, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "tag", "begin": f"<tool_call>\n<function={name}>\n",
            "content": {"type": "json_schema", "json_schema": arrays_with_items(parameters), "style": "qwen_xml"},
            "end": "</function>\n</tool_call>",
        }


def _value(text: str, schema: dict[str, Any] | None) -> Any:
    text = text.removeprefix("\n").removesuffix("\n")
    kind = (schema or {}).get("type")
    if kind == "string":
        return text
    if kind == "boolean" and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if kind is None or (kind in ("integer", "number") and isinstance(value, (int, float)) and not isinstance(
            value, bool)) or (kind == "object" and isinstance(value, dict)) or (
            kind == "array" and isinstance(value, list)) or (kind == "null" and value is None):
        return value
    return text
