"""Tool calling in chat: the calls a model writes as Hermes-style blocks (Qwen2.5,
Qwen3 and others), `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
turned into OpenAI `tool_calls`, whole or while streaming; and the grammar that
makes a model call a tool when the request requires it.
"""

import dataclasses
import json
import re
import uuid
from typing import Any

from .structured import JSON_LAYOUT, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def _call(body: str) -> dict[str, Any] | None:
    """An OpenAI tool call from a block's JSON, or None if it is not one."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(parsed, dict) and isinstance(parsed.get("name"), str)):
        return None
    arguments = parsed.get("arguments", parsed.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Splits a reply into its text (None if nothing is left) and its tool calls.

    A block whose JSON is not a call stays in the text, as does everything around
    the blocks; a last block that the reply ended before closing counts if its JSON
    is whole.
    """
    calls, kept, position = [], [], 0
    for block in _BLOCK.finditer(text):
        call = _call(block.group(1))
        kept.append(text[position : block.start()] if call else text[position : block.end()])
        calls += [call] if call else []
        position = block.end()
    rest = text[position:]
    if OPEN in rest:
        before, _, body = rest.partition(OPEN)
        call = _call(body)
        if call:
            calls.append(call)
            rest = before
    kept.append(rest)
    content = "".join(kept).strip()
    return content or None, calls


@dataclasses.dataclass
class ToolCallStream:
    """Streams a reply's text while holding back tool-call blocks until each is whole.

    `push(text)` returns the text that can be sent now and the calls completed;
    `finish()` the rest at the end. Text that might be the start of `<tool_call>`
    waits until it is clear that it is not.
    """

    buffer: str = ""
    calls: int = 0

    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.buffer += text
        out, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                # Keep the longest tail that could still grow into OPEN.
                keep = next((n for n in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                             if OPEN.startswith(self.buffer[-n:])), 0)
                out += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            end = self.buffer.find(CLOSE, start)
            if end < 0:  # inside a block: wait for its end
                out += self.buffer[:start]
                self.buffer = self.buffer[start:]
                break
            call = _call(self.buffer[start + len(OPEN) : end])
            out += self.buffer[:start] if call else self.buffer[: end + len(CLOSE)]
            calls += [call] if call else []
            self.buffer = self.buffer[end + len(CLOSE) :]
        self.calls += len(calls)
        return out, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        text, self.buffer = self.buffer, ""
        call = _call(text[len(OPEN) :]) if text.startswith(OPEN) else None  # a last block left open
        if call is None:
            return text, []
        self.calls += 1
        return "", [call]


def required_call(tools: list[dict[str, Any]], name: str | None, token_names: set[str]) -> StructuredOutput:
    """The constraint of `tool_choice` "required" (a call of any of `tools`) or of a
    named function: one block whose JSON names the function and holds arguments its
    `parameters` schema accepts. `token_names`: the tokenizer's single tokens among
    the block's tags (a tag that is one token must be written as that token)."""
    options = []
    for tool in tools:
        function = tool["function"]
        if name is None or function["name"] == name:
            options.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                            "properties": {"name": {"const": function["name"]},
                                           "arguments": function.get("parameters") or {"type": "object"}}})
    schema = {"x-guidance": JSON_LAYOUT, **(options[0] if len(options) == 1 else {"anyOf": options})}
    tag = lambda text: text if text in token_names else json.dumps(text)
    return StructuredOutput(grammar=f'start: {tag(OPEN)} "\\n" call "\\n" {tag(CLOSE)}\ncall: %json {json.dumps(schema)}')
