"""Helpers for tests of the grammar manager and the constraint checker: configs, requests,
compiles held back on demand, and imports seen from a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from vllm.config import ModelConfig, SchedulerConfig, StructuredOutputsConfig, VllmConfig
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.request import Request
from vllm.v1.structured_output.backends.auto import AutoBackend
from vllm.v1.structured_output.limits import SMALL_CONSTRAINT_LENGTH
from vllm.v1.structured_output.manager import StructuredOutputManager

MAX_NUM_SEQS = 96


def make_config(demo_dir: Path, **structured: Any) -> VllmConfig:
    """A config of the demo model with these structured-output options."""
    return VllmConfig(
        model_config=ModelConfig(model=str(demo_dir)),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS),
        structured_outputs_config=StructuredOutputsConfig(**structured),
    )


def manager_sharing(backend: Any, demo_dir: Path, **structured: Any) -> StructuredOutputManager:
    """A manager with its own config that reuses the session's backend (building one takes
    seconds). Its shutdown only clears the backend's cache."""
    manager = StructuredOutputManager(make_config(demo_dir, **structured))
    manager._backend = AutoBackend(backend.vocab_size, [("xgrammar", lambda: backend)])
    return manager


def make_request(req_id: str, **constraint: Any) -> Request:
    """A request of three prompt tokens with this constraint (none without one)."""
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(**constraint) if constraint else None
    )
    return Request(req_id, [1, 2, 3], params)


def wait_ready(request: Request, timeout_s: float = 10.0, deadline_s: float = 60.0) -> bool:
    """Polls like the scheduler until the grammar is ready (True) or failed (False)."""
    structured_req = request.structured_output_request
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if structured_req.poll(timeout_s):
            return True
        if structured_req.failed:
            return False
        time.sleep(0.002)
    raise AssertionError(f"{request.request_id}: neither ready nor failed after {deadline_s} s")


def big_regex(tag: str) -> str:
    """A regex longer than SMALL_CONSTRAINT_LENGTH: it compiles on the big-constraint lane."""
    return f"{tag}-" + "x" * (SMALL_CONSTRAINT_LENGTH + 1)


def block_big(monkeypatch: pytest.MonkeyPatch, manager: StructuredOutputManager) -> Any:
    """Makes compiles of regexes starting with 'blocked' wait until the returned event is set."""
    backend = manager.backend
    compile_choosing = backend.compile_choosing
    release = threading.Event()

    def blocking(params: StructuredOutputsParams, **kwargs: Any) -> Any:
        if params.regex is not None and params.regex.startswith("blocked"):
            assert release.wait(120), "the test never released the blocked compiles"
            return compile_choosing(StructuredOutputsParams(regex="x+"), **kwargs)
        return compile_choosing(params, **kwargs)

    monkeypatch.setattr(backend, "compile_choosing", blocking)
    return release


def modules_loaded_by(code: str, names: list[str]) -> list[str]:
    """Runs `code` in a fresh interpreter (from the repository root) and returns those of
    `names` that are in its sys.modules afterwards. Raises CalledProcessError (with the
    child's stderr) when the code fails."""
    report = f"print(json.dumps([m for m in {names!r} if m in sys.modules]))"
    script = f"import json, sys\n{code}\n{report}"
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
