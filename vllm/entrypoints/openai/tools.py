"""Tool calling for the chat API: which constraint a request's `tool_choice` needs, and how
tool calls are read back out of the model's text (whole, or as stream deltas).

- `none`: the model writes text; tools are still shown to it through the chat template.
- `required`: the reply is a JSON array of `{"name", "arguments"}` objects, one schema
  branch per function (`arguments` validated by its `parameters`); at most one call when
  `parallel_tool_calls` is false.
- a named function: the reply is that function's arguments (its `parameters` schema).
- `auto` (needs `--enable-auto-tool-choice --tool-call-parser hermes`): the model writes text
  and, in Qwen's Hermes format, `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`
  blocks. When a function is `strict`, a structural tag triggered by `<tool_call>`
  constrains every call's body (strict functions by their schema, the others to a JSON
  object), so free text stays free and calls stay valid.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from vllm.exceptions import InvalidRequestError

TOOL_CALL_PARSERS = ("hermes",)
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def new_call_id() -> str:
    """A fresh tool call id, `chatcmpl-tool-...`."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with its tools (see the module docstring)."""

    # "none", "auto", "required" or "named".
    mode: str
    # name -> parameters schema, in the request's order.
    functions: dict[str, dict[str, Any]]
    strict: frozenset[str] = frozenset()
    # The function a named tool_choice forces.
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        """True when the plan brings its own output constraint."""
        return self.mode in ("required", "named") or (self.mode == "auto" and bool(self.strict))

    def constraint(self) -> tuple[str, Any] | None:
        """(StructuredOutputsParams field, value) of the plan's constraint, or None."""
        if self.mode == "named":
            assert self.named is not None
            return "json", self.functions[self.named]
        if self.mode == "required":
            branches = [
                {
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for name, params in self.functions.items()
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": (
                branches[0] if len(branches) == 1 else {"anyOf": branches})}
            if not self.parallel:
                schema["maxItems"] = 1
            return "json", schema
        if self.mode == "auto" and self.strict:
            structures = [
                {
                    "begin": f'{CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ',
                    "schema": params if name in self.strict else _ANY_OBJECT,
                    "end": f"}}\n{CALL_END}",
                }
                for name, params in self.functions.items()
            ]
            return "structural_tag", {"structures": structures, "triggers": [CALL_START]}
        return None


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    auto_parser: str | None,
) -> ToolPlan | None:
    """The plan of a request's `tools` / `tool_choice`, or None without tools.

    `auto_parser` is the server's --tool-call-parser when --enable-auto-tool-choice is on.
    Raises InvalidRequestError naming the field: a malformed or duplicate function, a
    `parameters` that is not a JSON schema of an object, a tool_choice without tools or
    naming an unknown function, and `auto` on a server without a tool call parser.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "requires tools")
        return None
    functions: dict[str, dict[str, Any]] = {}
    strict: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        where = f"tools[{i}].function"
        if not _NAME.match(fn.name):
            raise InvalidRequestError(
                f"{where}.name", "must be 1 to 64 letters, digits, underscores or dashes")
        if fn.name in functions:
            raise InvalidRequestError(f"{where}.name", f"{fn.name!r} is defined twice")
        params = {"type": "object", "properties": {}} if fn.parameters is None else fn.parameters
        check_parameters(params, f"{where}.parameters")
        functions[fn.name] = params
        if fn.strict:
            strict.add(fn.name)
    mode, named = _choice(tool_choice, functions)
    if mode == "auto" and auto_parser is None:
        raise InvalidRequestError(
            "tool_choice",
            '"auto" needs a server started with --enable-auto-tool-choice and '
            "--tool-call-parser; use \"required\", a named function or \"none\"",
        )
    return ToolPlan(mode, functions, frozenset(strict), named,
                    parallel=parallel_tool_calls is not False)


def _choice(tool_choice: Any, functions: dict[str, Any]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                "tool_choice",
                f"{tool_choice!r} is not one of none, auto, required or a named function",
            )
        return tool_choice, None
    name = tool_choice.function.name
    if name not in functions:
        raise InvalidRequestError(
            "tool_choice.function.name",
            f"{name!r} is not one of the request's tools ({', '.join(functions)})",
        )
    return "named", name


def check_parameters(params: Any, param: str) -> None:
    """Raises InvalidRequestError naming `param` unless `params` is a valid JSON schema
    whose values are objects."""
    if not isinstance(params, dict):
        raise InvalidRequestError(param, "must be a JSON schema object")
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        raise InvalidRequestError(param, f"is not a valid JSON schema: {e.message}") from e
    if params.get("type", "object") != "object":
        raise InvalidRequestError(param, "must describe an object (\"type\": \"object\")")


# ---------------------------------------------------------------------- reading calls back


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply in Hermes format: every complete `<tool_call>` block
    that holds `{"name": str, "arguments": object}` becomes a call and leaves the content;
    anything else (an unclosed block, bad JSON) stays content. Content is None when only
    whitespace is left."""
    return parse_reply(ToolPlan("auto", {}), text)


def _hermes_call(body: str) -> ToolCall | None:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("name"), str)
        or not isinstance(data.get("arguments", {}), dict)
    ):
        return None
    return ToolCall(data["name"], json.dumps(data.get("arguments", {}), ensure_ascii=False))


def parse_reply(plan: ToolPlan, text: str | None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply's answer text under `plan`: exactly what its
    stream deltas add up to. Content is None when only whitespace is left. A `required`
    reply cut off by max_tokens keeps the calls it completed."""
    if text is None:
        return None, []
    stream = ToolCallStream(plan)
    content, deltas = stream.update(text)
    content = (content or "") + (stream.finish() or "")
    calls = [ToolCall(d["function"]["name"], d["function"]["arguments"], d["id"])
             for d in deltas]
    if plan.mode == "named":
        return None, calls
    return (content if content.strip() else None), calls


class ToolCallStream:
    """Turns one streamed reply's answer text into content deltas and tool call deltas.

    `update(text)` takes the next piece of the answer and returns (content delta or None,
    tool call deltas: OpenAI's `{"index", "id", "type", "function"}` dicts). A named
    function's arguments stream as they are written; a `required` reply's calls and an
    `auto` reply's `<tool_call>` blocks are sent whole, each as soon as it is complete.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._buffer = ""
        self._pos = 0  # required: where the next array element starts

    def update(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content delta, tool call deltas) after the answer grew by `text`."""
        mode = self.plan.mode
        if mode == "named":
            if not text and self.num_calls:
                return None, []
            deltas: list[dict[str, Any]] = []
            if not self.num_calls:
                self.num_calls = 1
                deltas.append({"index": 0, "id": new_call_id(), "type": "function",
                               "function": {"name": self.plan.named, "arguments": text}})
            else:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return None, deltas
        if mode == "required":
            self._buffer += text
            return None, self._complete_elements()
        if mode == "auto":
            self._buffer += text
            return self._hermes()
        return (text or None), []

    def _new_call(self, call: ToolCall) -> dict[str, Any]:
        delta = {"index": self.num_calls, **call.as_dict()}
        self.num_calls += 1
        return delta

    def _complete_elements(self) -> list[dict[str, Any]]:
        decoder = json.JSONDecoder()
        deltas = []
        buffer = self._buffer
        while True:
            pos = self._pos
            while pos < len(buffer) and buffer[pos] in " \t\r\n[,":
                pos += 1
            if pos >= len(buffer) or buffer[pos] == "]":
                return deltas
            try:
                element, end = decoder.raw_decode(buffer, pos)
            except json.JSONDecodeError:
                return deltas  # not complete yet
            self._pos = end
            if isinstance(element, dict) and isinstance(element.get("name"), str):
                args = json.dumps(element.get("arguments", {}), ensure_ascii=False)
                deltas.append(self._new_call(ToolCall(element["name"], args)))

    def _hermes(self) -> tuple[str | None, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._buffer:
            start = self._buffer.find(CALL_START)
            if start < 0:
                # Hold back a tail that may be the start of a <tool_call> tag.
                keep = _partial_suffix(self._buffer, CALL_START)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            content.append(self._buffer[:start])
            end = self._buffer.find(CALL_END, start)
            if end < 0:
                self._buffer = self._buffer[start:]
                break
            block = self._buffer[start:end + len(CALL_END)]
            self._buffer = self._buffer[end + len(CALL_END):]
            call = _hermes_call(block[len(CALL_START):-len(CALL_END)])
            if call is None:
                content.append(block)
            else:
                deltas.append(self._new_call(call))
        text = "".join(content)
        return (text or None), deltas

    def finish(self) -> str | None:
        """Content held back at the end of the reply (an unclosed `<tool_call>` block, an
        incomplete `required` array), or None."""
        if self.plan.mode == "auto" and self._buffer:
            rest, self._buffer = self._buffer, ""
            return rest
        if self.plan.mode == "required" and not self.num_calls and self._buffer:
            return self._buffer
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
