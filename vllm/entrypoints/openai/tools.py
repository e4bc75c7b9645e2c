"""Tool calling for the chat API: which constraint a request's `tool_choice` needs, and how
tool calls are read back out of the model's text (whole, or as stream deltas).

- `none`: the model writes text; tools are still shown to it through the chat template.
- `required`: the reply is a JSON array of `{"name", "arguments"}` objects, one schema
  branch per function (`arguments` validated by its `parameters`); at most one call when
  `parallel_tool_calls` is false.
- a named function: the reply is that function's arguments (its `parameters` schema).
- `auto` (needs `--enable-auto-tool-choice --tool-call-parser NAME`): the model writes text
  and calls in its family's format (`tool_parsers/`: hermes, mistral, llama3_json,
  qwen3_xml). When a function is `strict`, the format's structural tag constrains every
  call's body (strict functions by their schema, the others to a JSON object), so free text
  stays free and calls stay valid.

The server's `--tool-call-strict` policy makes calls strict whatever the client sent:
`function` treats every function as `strict` (each call names a requested tool and its
arguments follow that tool's `parameters`), `parameter` also closes every object of those
schemas (no properties beyond the listed ones, as OpenAI's strict mode), and `off` leaves
each function as the request says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from vllm.entrypoints.openai.tool_parsers import FORMATS, ToolFormat
from vllm.entrypoints.openai.tool_parsers.calls import JsonCallList, ToolCall, new_call_id
from vllm.exceptions import InvalidRequestError

TOOL_CALL_PARSERS = tuple(sorted(FORMATS))
# --tool-call-strict levels, weakest first.
TOOL_CALL_STRICT_LEVELS = ("off", "function", "parameter")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

__all__ = ["TOOL_CALL_PARSERS", "TOOL_CALL_STRICT_LEVELS", "ToolCall", "ToolCallStream", "ToolPlan", "parse_reply",
           "plan_tools"]


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
    # auto: the --tool-call-parser format the model writes calls in.
    parser: str | None = None
    # --tool-call-strict parameter: every object of the arguments' schemas is closed
    # (the constraint is compiled with disable_additional_properties).
    closed: bool = False

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
            assert self.parser is not None
            tag = FORMATS[self.parser].strict_tag(self.functions, self.strict, self.parallel)
            return "structural_tag", tag
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
    strict_policy: str = "off",
) -> ToolPlan | None:
    """The plan of a request's `tools` / `tool_choice`, or None without tools.

    `auto_parser` is the server's --tool-call-parser when --enable-auto-tool-choice is on;
    `strict_policy` its --tool-call-strict level (see the module docstring).
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
        if fn.strict or strict_policy != "off":
            strict.add(fn.name)
    mode, named = _choice(tool_choice, functions)
    if mode == "auto" and auto_parser is None:
        raise InvalidRequestError(
            "tool_choice",
            '"auto" needs a server started with --enable-auto-tool-choice and '
            "--tool-call-parser; use \"required\", a named function or \"none\"",
        )
    return ToolPlan(mode, functions, frozenset(strict), named,
                    parallel=parallel_tool_calls is not False,
                    parser=auto_parser if mode == "auto" else None,
                    closed=strict_policy == "parameter")


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


class ToolCallStream:
    """Turns one streamed reply's answer text into content deltas and tool call deltas.

    `update(text)` takes the next piece of the answer and returns (content delta or None,
    tool call deltas: OpenAI's `{"index", "id", "type", "function"}` dicts). A call is
    announced (index, id, name, empty arguments) as soon as its name is known and its
    arguments follow as they are written. A call that cannot be streamed (e.g. its arguments
    come before its name) is parsed whole when it ends: a call if it is one, else (auto) its
    text stays content.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._deltas: list[dict[str, Any]] = []
        self._format: ToolFormat | None = None
        if plan.mode == "auto":
            assert plan.parser is not None
            self._format = FORMATS[plan.parser](plan.functions)
        self._calls = JsonCallList() if plan.mode == "required" else None
        self._raw = ""  # required: the whole reply, content if it holds no call

    def update(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content delta, tool call deltas) after the answer grew by `text`."""
        content: str | None = None
        if self.plan.mode == "named":
            if text:  # nothing yet while the reply is still thinking
                if not self.num_calls:
                    self.announce(self.plan.named or "")
                self.arguments(text)
        elif self._calls is not None:
            self._raw += text
            self._calls.feed(text, self)
        elif self._format is not None:
            content = self._format.feed(text, self)
        else:
            content = text
        deltas, self._deltas = self._deltas, []
        return (content or None), deltas

    # The sink the readers report to (CallSink).

    def announce(self, name: str) -> None:
        """Opens call number `num_calls` with its id and name."""
        self.num_calls += 1
        self._deltas.append({"index": self.num_calls - 1, "id": new_call_id(),
                             "type": "function", "function": {"name": name, "arguments": ""}})

    def arguments(self, text: str) -> None:
        """More arguments of the open call (merged into its announcement when that is still
        waiting to be sent)."""
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last["index"] == self.num_calls - 1 and "id" in last:
            last["function"]["arguments"] += text
            return
        self._deltas.append({"index": self.num_calls - 1, "function": {"arguments": text}})

    def whole(self, call: ToolCall) -> None:
        """A call read whole."""
        self.announce(call.name)
        self.arguments(call.arguments)

    def finish(self) -> str | None:
        """Content held back at the end of the reply: an unclosed call block never
        announced, or a `required` reply that holds no call; else None."""
        if self._format is not None:
            return self._format.finish()
        if self.plan.mode == "required" and not self.num_calls:
            return self._raw or None
        return None
