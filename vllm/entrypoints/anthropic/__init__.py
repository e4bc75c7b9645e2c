"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), served through
the chat-completions path: requests are translated into chat requests, and the chat path's
outputs (text, reasoning, tool calls) into Anthropic's content blocks and events."""
