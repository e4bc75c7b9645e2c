"""The output items of a Responses reply and the server-sent events that stream them.

A streamed reply is a run of items, each opened (`response.output_item.added`), grown by
deltas and closed (`response.output_item.done`): reasoning text, message text, and function
calls, whose arguments stream as `response.function_call_arguments.delta` events while the
model writes them, as OpenAI's Responses stream does.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from vllm.entrypoints.openai.streaming import sse


def item_id(prefix: str) -> str:
    """A fresh output item id such as `msg_3f2a...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(rs_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning output item holding the thinking as reasoning text."""
    return {"type": "reasoning", "id": rs_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(msg_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message output item with one output_text part."""
    return {"type": "message", "id": msg_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str,
              fc_id: str | None = None) -> dict[str, Any]:
    """A function_call output item (its call_id is what a function_call_output answers)."""
    return {"type": "function_call", "id": fc_id or item_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


def _dumps(body: dict[str, Any]) -> str:
    """Compact JSON of one event."""
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class ResponseEvents:
    """The server-sent events of one Responses stream and the output items they build.

    Numbers every event. Reasoning and answer text arrive as deltas of the item being
    written; tool call deltas (ToolCallStream's, in chat's shape) open a function_call item
    and stream its arguments. The open item is closed when another starts or at `finish`.
    Answer text that is only whitespace is held back until more text comes: beside tool
    calls it is no message item, as in the whole response.
    """

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        # The item being written: [kind, its id, its text (arguments for a call), and for
        # a call its (call_id, name)].
        self.current: list[Any] | None = None
        self.num_calls = 0
        self._held = ""

    def emit(self, kind: str, **fields: Any) -> str:
        """One event, numbered in stream order."""
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\n" + sse(_dumps(body))

    def reasoning(self, delta: str) -> list[str]:
        """Events for more thinking text."""
        return self._write("reasoning", delta)

    def answer(self, delta: str) -> list[str]:
        """Events for more answer text (none while all of it so far is whitespace)."""
        text = self._held + delta
        if not text.strip():
            self._held = text
            return []
        self._held = ""
        return self._write("message", text)

    def tool_calls(self, deltas: list[dict[str, Any]]) -> list[str]:
        """Events for tool call deltas: one with an `id` opens a call (its name known),
        `function.arguments` add to the open call's arguments."""
        events: list[str] = []
        for delta in deltas:
            function = delta.get("function") or {}
            if "id" in delta:
                events += self._open_call(delta["id"], function.get("name") or "")
            if function.get("arguments"):
                events += self._arguments(function["arguments"])
        return events

    def finish(self, status: str = "completed") -> list[str]:
        """Events closing the reply's last item with `status`; held whitespace becomes the
        message of a reply without tool calls."""
        events: list[str] = []
        if self._held and not self.num_calls:
            held, self._held = self._held, ""
            events += self._write("message", held)
        return events + self._close(status)

    def _write(self, kind: str, delta: str) -> list[str]:
        """Events for `delta` of a text item of `kind`, opening it (and closing the open
        item of another kind) when needed."""
        events: list[str] = []
        if self.current is not None and self.current[0] != kind:
            events += self._close()
        index = len(self.output)
        if self.current is None:
            new_id = item_id("rs" if kind == "reasoning" else "msg")
            self.current = [kind, new_id, ""]
            if kind == "reasoning":
                added = {"type": "reasoning", "id": new_id, "summary": [],
                         "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                added = {"type": "message", "id": new_id, "role": "assistant",
                         "content": [], "status": "in_progress"}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.emit("response.output_item.added", output_index=index,
                                    item=added))
            events.append(self.emit("response.content_part.added", item_id=new_id,
                                    output_index=index, content_index=0, part=part))
        self.current[2] += delta
        name = ("response.reasoning_text.delta" if kind == "reasoning"
                else "response.output_text.delta")
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.emit(name, item_id=self.current[1], output_index=index,
                                content_index=0, delta=delta, **extra))
        return events

    def _open_call(self, call_id: str, name: str) -> list[str]:
        """Events opening a function_call item (closing the open item)."""
        events = self._close()
        self.num_calls += 1
        fc_id = item_id("fc")
        self.current = ["function_call", fc_id, "", (call_id, name)]
        events.append(self.emit("response.output_item.added", output_index=len(self.output),
                                item=call_item(call_id, name, "", "in_progress", fc_id)))
        return events

    def _arguments(self, delta: str) -> list[str]:
        """The event for more arguments of the open call."""
        assert self.current is not None and self.current[0] == "function_call"
        self.current[2] += delta
        return [self.emit("response.function_call_arguments.delta", item_id=self.current[1],
                          output_index=len(self.output), delta=delta)]

    def _close(self, status: str = "completed") -> list[str]:
        """Events that finish the item being written (none if no item is open)."""
        if self.current is None:
            return []
        kind, this_id, text = self.current[:3]
        index = len(self.output)
        if kind == "function_call":
            call_id, name = self.current[3]
            item = call_item(call_id, name, text, status, this_id)
            events = [self.emit("response.function_call_arguments.done", item_id=this_id,
                                output_index=index, arguments=text)]
        elif kind == "reasoning":
            item = reasoning_item(this_id, text, status)
            events = [
                self.emit("response.reasoning_text.done", item_id=this_id, output_index=index,
                          content_index=0, text=text),
                self.emit("response.content_part.done", item_id=this_id, output_index=index,
                          content_index=0, part={"type": "reasoning_text", "text": text}),
            ]
        else:
            item = message_item(this_id, text, status)
            events = [
                self.emit("response.output_text.done", item_id=this_id, output_index=index,
                          content_index=0, text=text, logprobs=[]),
                self.emit("response.content_part.done", item_id=this_id, output_index=index,
                          content_index=0, part=item["content"][0]),
            ]
        self.current = None
        self.output.append(item)
        events.append(self.emit("response.output_item.done", output_index=index, item=item))
        return events
