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

    def constraint(self) -> tuple[str, Any] | None:
        """(StructuredOutputsParams field, value) of the plan's constraint, or None."""
        if self.mode == "named":
            assert self.named is not None
            return "json", self.functions[self.named]
        if self.mode == "required":
            branches = []
            defs: dict[str, Any] = {}
            for i, (name, params) in enumerate(self.functions.items()):
                params, own_defs = _hoist_definitions(params, f"f{i}_")
                defs.update(own_defs)
                branches.append({
                    "type": "object",
                    "properties": {"name": {"const": name}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                })
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": (
                branches[0] if len(branches) == 1 else {"anyOf": branches})}
            if not self.parallel:
                schema["maxItems"] = 1
            if defs:
                schema["$defs"] = defs
            return "json", schema
        if self.mode == "auto" and self.strict:
            tags = [
                {
                    "type": "tag",
                    "begin": f'{CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ',
                    "content": {"type": "json_schema",
                                "json_schema": params if name in self.strict else _ANY_OBJECT},
                    "end": f"}}\n{CALL_END}",
                }
                for name, params in self.functions.items()
            ]
            return "structural_tag", {"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": [CALL_START], "tags": tags,
                # parallel_tool_calls false: the reply ends after its one call.
                "stop_after_first": not self.parallel,
            }}
        return None


def _hoist_definitions(params: Any, prefix: str) -> tuple[Any, dict[str, Any]]:
    """A tool's parameters schema ready to nest inside another schema: its `$defs` and
    `definitions` come out (renamed `prefix` + name, so two tools' same-named definitions do
    not collide) to be placed at the new root, and every local `$ref` is rewritten to match.
    A `$ref` to anything else in the tool's own schema ("#", "#/properties/...") points at a
    copy of that schema kept among the definitions."""
    if not isinstance(params, dict):
        return params, {}
    root_name = f"{prefix}root"
    uses_root = False

    def rewrite(ref: str) -> str:
        nonlocal uses_root
        for section in ("#/$defs/", "#/definitions/"):
            if ref.startswith(section):
                return "#/$defs/" + prefix + ref[len(section):]
        if ref == "#" or ref.startswith("#/"):
            uses_root = True
            return f"#/$defs/{root_name}" + ref[1:]
        return ref  # not local: left as the user wrote it

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: rewrite(v) if k == "$ref" and isinstance(v, str) else walk(v)
                    for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    body = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
    defs: dict[str, Any] = {}
    for section in ("definitions", "$defs"):
        for name, value in (params.get(section) or {}).items():
            defs[prefix + name] = walk(value)
    body = walk(body)
    if not defs and not uses_root:
        return params, {}
    if uses_root:
        defs[root_name] = body
    return body, defs


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


def _call_from_json(text: str) -> ToolCall | None:
    """The call in `text` when it is one JSON object `{"name": str, "arguments": object}`
    (arguments may be absent), else None."""
    try:
        data = json.loads(text)
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
    stream deltas add up to. Content is None when only whitespace is left. A reply cut off
    by max_tokens keeps the calls it started, their arguments cut off too (as OpenAI's)."""
    if text is None:
        return None, []
    stream = ToolCallStream(plan)
    content, deltas = stream.update(text)
    content = (content or "") + (stream.finish() or "")
    parts: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            parts[d["index"]] = [d["id"], d["function"]["name"], ""]
        parts[d["index"]][2] += d["function"]["arguments"]
    calls = [ToolCall(name, args, call_id) for call_id, name, args in parts.values()]
    if plan.mode == "named":
        return None, calls
    return (content if content.strip() else None), calls


class _ValueEnd:
    """Finds where one JSON object or array ends in text that arrives in pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.done = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value (all of them until it ends)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


class _CallReader:
    """Reads one `{"name": ..., "arguments": {...}}` object as it arrives: once the name is
    known it announces the call, then passes on the arguments' text as it is written."""

    _HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def __init__(self) -> None:
        self.text = ""
        self.name: str | None = None
        self._args_at: int | None = None  # where the arguments start in `text`
        self._args = _ValueEnd()

    def feed(self, piece: str) -> tuple[str | None, str]:
        """(the name, when it has just become known; new arguments text)."""
        self.text += piece
        announced = None
        if self._args_at is None:
            match = self._HEADER.match(self.text)
            # The arguments must start (with an object) before the header is taken as whole.
            if match is None or match.end() == len(self.text):
                return None, ""
            if self.text[match.end()] != "{":
                self._args_at = -1  # not an object: the call is read whole at its end
                return None, ""
            try:
                self.name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                self._args_at = -1
                return None, ""
            announced = self.name
            self._args_at = match.end()
            piece = self.text[self._args_at:]
        if self._args_at < 0 or self._args.done:
            return announced, ""
        return announced, piece[: self._args.feed(piece)]

    @property
    def streaming(self) -> bool:
        """True once the call was announced (its deltas are out)."""
        return self.name is not None


class ToolCallStream:
    """Turns one streamed reply's answer text into content deltas and tool call deltas.

    `update(text)` takes the next piece of the answer and returns (content delta or None,
    tool call deltas: OpenAI's `{"index", "id", "type", "function"}` dicts). A call is
    announced (index, id, name, empty arguments) as soon as its name is known and its
    arguments follow as they are written. A call whose text does not start with
    `{"name": ..., "arguments": {` is parsed whole when it ends: a call if it is one, else
    (auto) the block stays content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._buffer = ""
        # auto: inside a <tool_call> block; required: inside an array element.
        self._reader: _CallReader | None = None
        self._element: _ValueEnd | None = None
        self._raw = ""  # required: the whole reply, content if it holds no call

    def update(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content delta, tool call deltas) after the answer grew by `text`."""
        mode = self.plan.mode
        if mode == "named":
            if not text:  # e.g. the reply is still thinking
                return None, []
            deltas: list[dict[str, Any]] = []
            if not self.num_calls:
                self.num_calls = 1
                deltas.append({"index": 0, "id": new_call_id(), "type": "function",
                               "function": {"name": self.plan.named, "arguments": text}})
            else:
                deltas.append({"index": 0, "function": {"arguments": text}})
            return None, deltas
        self._buffer += text
        if mode == "required":
            self._raw += text
            return None, self._required()
        if mode == "auto":
            return self._hermes()
        text, self._buffer = self._buffer, ""
        return (text or None), []

    def _announce(self, name: str) -> dict[str, Any]:
        self.num_calls += 1
        return {"index": self.num_calls - 1, "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": ""}}

    def _feed(self, reader: _CallReader, piece: str, deltas: list[dict[str, Any]]) -> None:
        name, args = reader.feed(piece)
        if name is not None:
            deltas.append(self._announce(name))
        if args:
            deltas.append({"index": self.num_calls - 1, "function": {"arguments": args}})

    def _whole(self, call: ToolCall, deltas: list[dict[str, Any]]) -> None:
        delta = self._announce(call.name)
        delta["function"]["arguments"] = call.arguments
        deltas.append(delta)

    def _required(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while self._buffer:
            if self._reader is None:
                skipped = len(self._buffer) - len(self._buffer.lstrip(" \t\r\n[,]"))
                self._buffer = self._buffer[skipped:]
                if not self._buffer:
                    break
                self._reader, self._element = _CallReader(), _ValueEnd()
            assert self._element is not None
            n = self._element.feed(self._buffer)
            piece, self._buffer = self._buffer[:n], self._buffer[n:]
            self._feed(self._reader, piece, deltas)
            if not self._element.done:
                break
            reader, self._reader = self._reader, None
            if not reader.streaming and (call := _call_from_json(reader.text)) is not None:
                self._whole(call, deltas)
        return deltas

    def _hermes(self) -> tuple[str | None, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self._buffer:
            if self._reader is None:
                start = self._buffer.find(CALL_START)
                if start < 0:
                    # Hold back a tail that may be the start of a <tool_call> tag.
                    keep = _partial_suffix(self._buffer, CALL_START)
                    content.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(CALL_START):]
                self._reader = _CallReader()
                continue
            end = self._buffer.find(CALL_END)
            # Hold back a tail that may be the start of </tool_call>.
            usable = len(self._buffer) - _partial_suffix(self._buffer, CALL_END) if end < 0 else end
            self._feed(self._reader, self._buffer[:usable], deltas)
            self._buffer = self._buffer[usable:]
            if end < 0:
                break
            self._buffer = self._buffer[len(CALL_END):]
            reader, self._reader = self._reader, None
            if not reader.streaming:
                call = _call_from_json(reader.text)
                if call is None:
                    content.append(CALL_START + reader.text + CALL_END)
                else:
                    self._whole(call, deltas)
        text = "".join(content)
        return (text or None), deltas

    def finish(self) -> str | None:
        """Content held back at the end of the reply: an unclosed `<tool_call>` block whose
        call was never announced, or a `required` reply that holds no call; else None."""
        rest = None
        if self.plan.mode == "auto":
            reader = self._reader
            if reader is not None and not reader.streaming:
                rest = CALL_START + reader.text + self._buffer
            elif reader is None and self._buffer:
                rest = self._buffer
        elif self.plan.mode == "required" and not self.num_calls:
            rest = self._raw or None
        self._buffer = ""
        self._reader = None
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
