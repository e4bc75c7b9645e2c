"""The server-sent events of a streaming /v1/messages answer, in Anthropic's order:
`message_start`; per content block `content_block_start`, its deltas (`thinking_delta`,
`text_delta`, `input_json_delta`) and `content_block_stop`; then `message_delta` (the stop
reason and the output token count) and `message_stop`. A failure ends the stream with an
`error` event instead.

Blocks follow the rules of a whole answer (serving_messages.content_blocks), so a stream's
blocks add up to the message a non-streaming request gets: a text block opens only once its
text holds more than whitespace, and whitespace at the end of a text block that a tool call
follows is left out."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from vllm.entrypoints.anthropic.errors import error_event, sse_event
from vllm.entrypoints.anthropic.translate import tool_use_id
from vllm.entrypoints.openai.errors import exception_error

logger = logging.getLogger(__name__)


async def anthropic_events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """`chunks` as they come; any failure (an engine death included) becomes a final
    `error` event of its kind, logged with its traceback unless the engine died."""
    # Closing this stream (client gone) must close `chunks` at once, so that it aborts its
    # engine requests now rather than when garbage collected.
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as e:
            failure = exception_error(e)
            if failure.status >= 500 and failure.status != 503:
                logger.exception("a streaming /v1/messages response failed")
            yield error_event(failure.message, failure.status)


class MessageEvents:
    """The events of one streamed message, block by block (see the module docstring)."""

    def __init__(self, message_id: str, model: str) -> None:
        self.message_id = message_id
        self.model = model
        self.num_blocks = 0
        # The kind of the open block ("thinking", "text", "tool_use"), None between blocks.
        self.open: str | None = None
        # Whitespace not sent yet: it opens a text block or joins one only when more text
        # than whitespace follows (or, in an open text block, when the message ends).
        self.pending = ""

    def start(self, input_tokens: int) -> str:
        """`message_start`: the message with no content yet."""
        return sse_event("message_start", {"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "content": [],
            "model": self.model, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0}}})

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"type": "content_block_delta",
                                                 "index": self.num_blocks - 1, "delta": delta})

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.open = kind
        self.num_blocks += 1
        events.append(sse_event("content_block_start", {
            "type": "content_block_start", "index": self.num_blocks - 1,
            "content_block": block}))
        return events

    def close(self) -> list[str]:
        """`content_block_stop` of the open block (nothing when none is open); whitespace
        held back from a text block is dropped."""
        self.pending = ""
        if self.open is None:
            return []
        self.open = None
        return [sse_event("content_block_stop", {"type": "content_block_stop",
                                                 "index": self.num_blocks - 1})]

    def thinking(self, text: str) -> list[str]:
        """Events for more reasoning text."""
        events = []
        if self.open != "thinking":
            events = self._open("thinking", {"type": "thinking", "thinking": "",
                                             "signature": ""})
        events.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return events

    def text(self, text: str) -> list[str]:
        """Events for more answer text (none while it is whitespace held back)."""
        text = self.pending + text
        body = text.rstrip()
        if not body:
            self.pending = text
            return []
        events = []
        if self.open != "text":
            events = self._open("text", {"type": "text", "text": ""})
        # After opening: closing the block before drops what was held back.
        self.pending = text[len(body):]
        events.append(self._delta({"type": "text_delta", "text": body}))
        return events

    def tool_call(self, delta: dict[str, Any]) -> list[str]:
        """Events for a chat tool-call delta: a new call opens a tool_use block, and its
        arguments text follows as input_json_delta."""
        events = []
        function = delta.get("function", {})
        if "id" in delta:
            events = self._open("tool_use", {"type": "tool_use", "id": tool_use_id(delta["id"]),
                                             "name": function.get("name", ""), "input": {}})
        if function.get("arguments"):
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": function["arguments"]}))
        return events

    def finish(self, stop_reason: str | None, stop_sequence: str | None,
               output_tokens: int) -> list[str]:
        """The events that end the message: the last block's end (its held-back whitespace
        first, when it is a text block), `message_delta` and `message_stop`."""
        events = []
        if self.open == "text" and self.pending:
            events.append(self._delta({"type": "text_delta", "text": self.pending}))
        events += self.close()
        events.append(sse_event("message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": output_tokens}}))
        events.append(sse_event("message_stop", {"type": "message_stop"}))
        return events
