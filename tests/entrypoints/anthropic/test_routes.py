"""The Anthropic routes sit behind the same request gate as the OpenAI routes (a draining
server refuses new generation requests with a 503 and Retry-After) and answer every error,
the gate's and the router's included, in Anthropic's shape. No engine is needed: none of
these requests reaches one."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.testclient import TestClient

from vllm.entrypoints.openai.api_server import build_app
from vllm.v1.metrics.prometheus import PrometheusMetrics


def _client() -> tuple[TestClient, object]:
    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=16, vocab_size=32),
                             tokenizer=None, is_healthy=True, dead_engines={},
                             dead_reason=None)
    models = SimpleNamespace(lora_validator=None)
    app = build_app(engine, models, PrometheusMetrics("m"))
    return TestClient(app, raise_server_exceptions=False), app.state.gate


def _anthropic_error(reply, status: int, kind: str) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_a_draining_server_refuses_messages_as_overloaded() -> None:
    client, gate = _client()
    gate.draining = True
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    reply = client.post("/v1/messages", json=body)
    assert "shutting down" in _anthropic_error(reply, 503, "overloaded_error")
    assert reply.headers["Retry-After"] == "1"
    # Counting tokens generates nothing: the drain lets it through to its own checks.
    reply = client.post("/v1/messages/count_tokens", json={"model": "m"})
    assert "messages" in _anthropic_error(reply, 400, "invalid_request_error")


def test_body_and_router_errors_are_in_anthropics_shape() -> None:
    client, _ = _client()
    reply = client.post("/v1/messages", content=b"{not json")
    assert "Invalid JSON body" in _anthropic_error(reply, 400, "invalid_request_error")
    reply = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": [],
                                              "temprature": 0})
    assert "temprature" in _anthropic_error(reply, 400, "invalid_request_error")
    _anthropic_error(client.get("/v1/messages"), 405, "invalid_request_error")
