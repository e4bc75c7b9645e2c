"""`vllm serve` starts its engine-core process with the OpenMP policy in its environment."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from vllm.thread_policy import available_cpus

if TYPE_CHECKING:
    from tests.entrypoints.openai.conftest import RemoteServer


def initial_environ(pid: int) -> dict[str, str]:
    """The environment process `pid` was started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.timeout(300)
def test_engine_core_starts_with_the_thread_policy(
    start_server: Callable[..., RemoteServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    server = start_server("demo-tiny", "--max-model-len", "256", "--disable-log-requests")
    env = initial_environ(server.engine_pid)
    assert env.get("OMP_WAIT_POLICY") == "PASSIVE"
    assert env.get("OMP_NUM_THREADS") == str(available_cpus())
    assert "OMP_WAIT_POLICY" not in server.log()  # no warning: the policy was in time
