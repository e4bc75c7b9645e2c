"""The Anthropic API tests start their server as the OpenAI server tests do."""

from __future__ import annotations

from tests.entrypoints.openai.conftest import start_server  # noqa: F401  (a fixture)
