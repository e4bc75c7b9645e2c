"""With --api-key, every route of the app needs the key except /health. The routes are read
from the app itself, so a route added later (an admin route, /tokenize) is covered without
editing this test. The real server is checked in test_errors.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from vllm.entrypoints.anthropic.errors import ANTHROPIC_PATHS
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.gate import OPEN_PATHS
from vllm.v1.metrics.prometheus import PrometheusMetrics

KEY = "sk-route-key"


def _app():
    # Stands in for AsyncLLM: the routes under test never reach the engine without the key,
    # and with it only /health, /version, /metrics and /v1/models are called.
    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=16, vocab_size=32),
                             tokenizer=None,
                             is_healthy=True, dead_engines={}, dead_reason=None)
    # A LoRA validator and the runtime switch: the adapter admin routes exist, so the key is
    # checked on them too.
    models = SimpleNamespace(show_available_models=lambda: SimpleNamespace(
        model_dump_json=lambda: '{"object": "list", "data": []}'), lora_validator=object(),
        lora_allowed_roots=[])
    return build_app(engine, models, PrometheusMetrics("m"), api_key=KEY,
                     allow_runtime_lora_updating=True)


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app serves: its API routes and FastAPI's own
    (/docs, /openapi.json, ...)."""
    out = []
    for route in _app().routes:
        if isinstance(route, Route):
            out += [(method, route.path) for method in sorted(route.methods or {"GET"})]
    return out


def test_the_app_has_the_routes_this_test_expects() -> None:
    paths = {path for _, path in _routes()}
    assert {"/health", "/metrics", "/version", "/v1/models", "/v1/completions",
            "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
            "/v1/messages", "/v1/messages/count_tokens",
            "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/openapi.json",
            "/docs"} <= paths


@pytest.mark.parametrize("method,path", _routes() + [("GET", "/nowhere"), ("GET", "/v1/x")])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}, {"Authorization": f"bearer {KEY}x"},
                                     {"x-api-key": f"{KEY}x"}, {"x-api-key": f"Bearer {KEY}"}])
def test_every_route_but_health_needs_the_key(method: str, path: str, headers) -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    r = client.request(method, path, headers=headers)
    if path in OPEN_PATHS:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        if method == "HEAD":  # a HEAD answer has no body
            return
        if path in ANTHROPIC_PATHS:  # Anthropic's error shape on Anthropic's routes
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
        else:
            assert r.json()["error"]["code"] == 401


@pytest.mark.parametrize("path", ["/health", "/version", "/metrics", "/v1/models"])
@pytest.mark.parametrize("headers", [{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}])
def test_the_key_opens_every_route(path: str, headers: dict[str, str]) -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    r = client.get(path, headers=headers)
    assert r.status_code == 200, r.text


def test_only_health_is_open() -> None:
    assert OPEN_PATHS == frozenset({"/health"})
