"""`vllm serve` with an upstream command line: a hub id from the hub cache (offline), and
upstream flags that have no effect here, which start the server with one warning each."""

from __future__ import annotations

from pathlib import Path

from tests.transformers_utils.test_hub import build_hub_cache

from .conftest import RemoteServer

NO_EFFECT = ("--disable-frontend-multiprocessing", "--enable-prompt-tokens-details",
             "--log-error-stack", "--disable-log-stats", "--swap-space", "4",
             "--no-enable-chunked-prefill")


def test_serve_hub_id_with_upstream_flags(start_server, tmp_path: Path) -> None:
    cache = build_hub_cache(tmp_path / "hub")
    server: RemoteServer = start_server(
        "org/tiny", "--max-model-len", "256", "--tokenizer-mode", "auto",
        "--config-format", "hf", "--load-format", "auto", "--max-num-batched-tokens", "64",
        *NO_EFFECT,
        env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)},
    )
    log = server.log()
    assert "serving model 'org/tiny'" in log and str(cache) in log
    assert "async scheduling: on" in log
    for flag in ("--disable-frontend-multiprocessing", "--enable-prompt-tokens-details",
                 "--log-error-stack", "disable_log_stats", "swap_space",
                 "enable_chunked_prefill=False"):
        assert log.count(f"{flag} has no effect") == 1, flag
    out = server.client().completions.create(model="org/tiny", prompt="Hi", max_tokens=4,
                                             temperature=0)
    assert out.usage.completion_tokens == 4
