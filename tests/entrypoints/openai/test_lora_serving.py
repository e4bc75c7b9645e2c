"""`vllm serve --enable-lora --lora-modules ...`: adapters are models of their own.

A request picks an adapter by its `model` field and gets what the offline engine gives with
that adapter; /v1/models lists adapters with their parent; adapters load and unload at run
time, only with the runtime switch and only from the allowed directories; an unknown adapter
is a 404 in OpenAI's error shape.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from starlette.testclient import TestClient

from tests.lora.utils import ALL_TARGETS, build_adapter
from vllm import LLM, SamplingParams
from vllm.exceptions import InvalidRequestError
from vllm.lora.request import LoRARequest
from vllm.model_executor.model_loader.demo_model import build_demo_model

MODEL = "demo-tiny"
PROMPT = "alpha beta gamma delta"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(build_demo_model(MODEL)),
                                              dtype=torch.float32)
    root = tmp_path_factory.mktemp("serve_lora")
    build_adapter(hf, root / "one", seed=1, targets=ALL_TARGETS, r=4)
    build_adapter(hf, root / "two", seed=2, targets=["v_proj", "down_proj"], r=8)
    build_adapter(hf, root / "three", seed=3, targets=["q_proj"], r=2)
    build_adapter(hf, root / "big", seed=4, targets=["q_proj"], r=32)
    return root


@pytest.fixture(scope="module")
def offline(adapters) -> dict[str | None, str]:
    """The greedy text of PROMPT per adapter (None: base) from the offline engine."""
    llm = LLM(model=MODEL, enable_lora=True, max_loras=2, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = {}
    for i, name in enumerate([None, "one", "two", "three"]):
        lora = LoRARequest(name, i, str(adapters / name)) if name else None
        (out,) = llm.generate([PROMPT], params, use_tqdm=False, lora_request=lora)
        texts[name] = out.outputs[0].text
    llm.shutdown()
    return texts


@pytest.fixture(scope="module")
def server(start_server, adapters):
    two = json.dumps({"name": "two", "path": str(adapters / "two"),
                      "base_model_name": MODEL})
    return start_server(MODEL, "--max-model-len", "256", "--enable-lora", "--max-loras", "2",
                        "--lora-modules", f"one={adapters / 'one'}", two,
                        "--allow-runtime-lora-updating")


def _complete(server, model: str) -> httpx.Response:
    return httpx.post(server.url("/v1/completions"), json={
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True,
    }, timeout=60)


def test_models_lists_adapters_with_parent(server, adapters) -> None:
    data = httpx.get(server.url("/v1/models")).json()["data"]
    cards = {card["id"]: card for card in data}
    assert set(cards) == {MODEL, "one", "two"}
    assert cards[MODEL]["parent"] is None
    assert cards["one"]["parent"] == MODEL and cards["one"]["root"] == str(adapters / "one")
    assert cards["two"]["parent"] == MODEL


def test_model_field_picks_the_adapter(server, offline) -> None:
    for model, key in ((MODEL, None), ("one", "one"), ("two", "two")):
        response = _complete(server, model)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["model"] == model
        assert body["choices"][0]["text"] == offline[key], model
    assert offline["one"] != offline[None] and offline["two"] != offline[None]
    chat = httpx.post(server.url("/v1/chat/completions"), json={
        "model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
    }, timeout=60)
    assert chat.status_code == 200 and chat.json()["model"] == "one"


def test_unknown_adapter_is_404(server) -> None:
    response = _complete(server, "nope")
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == 404 and error["param"] == "model" and "nope" in error["message"]


def test_load_and_unload_at_run_time(server, adapters, offline) -> None:
    load = server.url("/v1/load_lora_adapter")
    unload = server.url("/v1/unload_lora_adapter")
    response = httpx.post(load, json={"lora_name": "three", "lora_path": str(adapters / "three")})
    assert response.status_code == 200, response.text
    assert _complete(server, "three").json()["choices"][0]["text"] == offline["three"]
    assert "three" in {c["id"] for c in httpx.get(server.url("/v1/models")).json()["data"]}
    # A taken name, an unfit adapter, a missing directory: 400 naming the cause.
    taken = httpx.post(load, json={"lora_name": "one", "lora_path": str(adapters / "three")})
    assert taken.status_code == 400 and "already served" in taken.json()["error"]["message"]
    big = httpx.post(load, json={"lora_name": "big", "lora_path": str(adapters / "big")})
    assert big.status_code == 400 and "--max-lora-rank 16" in big.json()["error"]["message"]
    gone = httpx.post(load, json={"lora_name": "gone", "lora_path": str(adapters / "gone")})
    assert gone.status_code == 400 and "adapter_config.json" in gone.json()["error"]["message"]
    assert httpx.post(unload, json={"lora_name": "three"}).status_code == 200
    again = httpx.post(unload, json={"lora_name": "three"})
    assert again.status_code == 404 and again.json()["error"]["code"] == 404
    assert _complete(server, "three").status_code == 404
    # Serving continues for the others.
    assert _complete(server, "one").json()["choices"][0]["text"] == offline["one"]


@pytest.fixture(scope="module")
def outside(tmp_path_factory, adapters):
    """A fit adapter in a directory beside the served ones' (outside the allowed roots)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(build_demo_model(MODEL)),
                                              dtype=torch.float32)
    root = tmp_path_factory.mktemp("outside")
    build_adapter(hf, root / "fit", seed=5, targets=["q_proj"], r=2)
    return root


def test_runtime_paths_outside_the_roots_get_one_answer(server, adapters, outside) -> None:
    load = server.url("/v1/load_lora_adapter")
    link = adapters / "link-out"
    link.symlink_to(outside / "fit")
    paths = [
        outside / "fit",                            # a fit adapter, outside
        outside / "missing",                        # nothing there
        adapters / ".." / outside.name / "fit",     # out of a root by `..`
        link,                                       # out by a link placed inside a root
        "/etc/passwd",                              # a file
    ]
    answers = set()
    for path in paths:
        response = httpx.post(load, json={"lora_name": "x", "lora_path": str(path)})
        assert response.status_code == 400, (path, response.text)
        answers.add(response.text)
    # One body whatever is there: a client learns nothing about the disk outside the roots.
    (answer,) = answers
    error = json.loads(answer)["error"]
    assert error["param"] == "lora_path" and "--lora-allowed-dir" in error["message"]
    assert "x" not in {c["id"] for c in httpx.get(server.url("/v1/models")).json()["data"]}


class RefusingValidator:
    """Refuses every adapter: a load route that exists answers 400, not 404."""

    def check(self, request: LoRARequest) -> None:
        raise InvalidRequestError("lora_path", "refused")

    def forget(self, request: LoRARequest) -> None:
        pass


@pytest.mark.parametrize(("env", "flag", "exists"), [
    (None, False, False), ("0", False, False), ("1", False, True), ("true", False, True),
    (None, True, True),
])
def test_adapter_routes_exist_only_with_the_switch(monkeypatch, tmp_path, env, flag,
                                                   exists) -> None:
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.serving_models import OpenAIServingModels
    from vllm.v1.metrics.prometheus import PrometheusMetrics

    if env is None:
        monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", env)
    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=16, vocab_size=32),
                             tokenizer=None)
    models = OpenAIServingModels([MODEL], "/m", 16, RefusingValidator(),
                                 lora_allowed_roots=[str(tmp_path.resolve())])
    # Built after the variable is set: the switch is read when the app is built.
    app = build_app(engine, models, PrometheusMetrics("m"), allow_runtime_lora_updating=flag)
    client = TestClient(app, raise_server_exceptions=False)
    load = client.post("/v1/load_lora_adapter",
                       json={"lora_name": "x", "lora_path": str(tmp_path / "one")})
    unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    if exists:
        assert load.status_code == 400 and "refused" in load.text
        assert unload.status_code == 404 and unload.json()["error"]["param"] == "lora_name"
    else:
        assert load.status_code == 404 and unload.status_code == 404
        assert unload.json()["error"]["message"] == "Not Found"


def test_adapter_route_bodies_are_read_as_every_body(tmp_path) -> None:
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.serving_models import OpenAIServingModels
    from vllm.v1.metrics.prometheus import PrometheusMetrics

    engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=16, vocab_size=32),
                             tokenizer=None)
    models = OpenAIServingModels([MODEL], "/m", 16, RefusingValidator(),
                                 lora_allowed_roots=[str(tmp_path.resolve())])
    app = build_app(engine, models, PrometheusMetrics("m"), max_body_bytes=256,
                    allow_runtime_lora_updating=True)
    client = TestClient(app, raise_server_exceptions=False)
    load = "/v1/load_lora_adapter"
    # Bounded by --max-request-body-bytes like the API's bodies, and strict JSON.
    big = client.post(load, json={"lora_name": "x", "lora_path": "p" * 300})
    assert big.status_code == 413 and "256 bytes" in big.json()["error"]["message"]
    nan = client.post(load, content=b'{"lora_name": "x", "lora_path": NaN}')
    assert nan.status_code == 400 and "Invalid JSON body" in nan.json()["error"]["message"]
    base = client.post(load, json={"lora_name": "x", "lora_path": "p", "base_model_name": 5})
    assert base.status_code == 400 and base.json()["error"]["param"] == "base_model_name"


def test_lora_flags_are_checked_before_startup(adapters, capsys) -> None:
    from vllm.entrypoints.openai.api_server import main

    assert main([MODEL, "--lora-modules", f"one={adapters / 'one'}"]) == 2
    assert "--lora-modules: needs --enable-lora" in capsys.readouterr().err
    assert main([MODEL, "--enable-lora", "--lora-modules", "no-path"]) == 2
    assert "name=path" in capsys.readouterr().err
    assert main([MODEL, "--enable-lora", "--lora-modules", f"big={adapters / 'big'}"]) == 2
    assert "--max-lora-rank" in capsys.readouterr().err
    assert main([MODEL, "--lora-allowed-dir", str(adapters)]) == 2
    assert "--lora-allowed-dir: needs --enable-lora" in capsys.readouterr().err
    assert main([MODEL, "--enable-lora", "--lora-allowed-dir", str(adapters / "nope")]) == 2
    assert "--lora-allowed-dir: " in capsys.readouterr().err
