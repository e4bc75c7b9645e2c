"""EngineCoreClient: an engine-core process driven over ZMQ, compared with the in-process engine."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from tests.utils_wait import wait_until
from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs
from vllm.exceptions import EngineConfigError
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.core_client import EngineCoreClient, EngineDeadError
from vllm.v1.executor.multiproc_executor import ipc_dir_prefix
from vllm.v1.metrics.engine_stats import EngineCoreStats

MODEL = "demo-tiny"
MAX_MODEL_LEN = 256
PROMPTS = [[9707, 1879], [9707, 11, 1879, 0], list(range(100, 140))]


def _config(**kwargs):
    return EngineArgs(model=MODEL, max_model_len=MAX_MODEL_LEN, **kwargs).create_engine_config()


def _request(rid: str, prompt: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),
        arrival_time=time.monotonic(),
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class Collector:
    """Callbacks that record what the client delivers."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.stats: list[EngineCoreStats] = []
        self.dead: list[str] = []
        self.changed = asyncio.Event()

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        for out in outputs.outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                self.finish[out.request_id] = out.finish_reason
        self.changed.set()

    def on_stats(self, stats: EngineCoreStats) -> None:
        self.stats.append(stats)
        self.changed.set()

    def on_dead(self, reason: str) -> None:
        self.dead.append(reason)
        self.changed.set()

    async def wait_for(self, predicate, timeout_s: float = 60.0) -> None:
        async def loop() -> None:
            while not predicate():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(loop(), timeout_s)


@pytest.fixture(scope="module")
def reference_tokens() -> list[list[int]]:
    """Greedy tokens of the in-process engine (the oracle for the process boundary)."""
    llm = LLM(MODEL, max_model_len=MAX_MODEL_LEN)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def test_outputs_abort_stats_and_shutdown(reference_tokens):
    client = EngineCoreClient(_config())
    ipc_dir = client._ipc_dir
    pid = client.pid
    assert client.num_blocks > 0 and _alive(pid)

    async def run() -> Collector:
        col = Collector()
        client.start(col.on_outputs, col.on_stats, col.on_dead)
        for i, prompt in enumerate(PROMPTS):
            client.add_request(_request(f"r{i}", prompt, temperature=0, max_tokens=12,
                                        ignore_eos=True))
        await col.wait_for(lambda: len(col.finish) == len(PROMPTS))
        assert [col.tokens[f"r{i}"] for i in range(len(PROMPTS))] == reference_tokens
        assert all(col.finish[f"r{i}"] == "length" for i in range(len(PROMPTS)))

        # A long request, aborted after its first tokens: the engine frees everything.
        client.add_request(_request("long", [1, 2, 3], max_tokens=200, ignore_eos=True))
        await col.wait_for(lambda: len(col.tokens.get("long", [])) >= 2)
        client.abort_requests(["long", "never-existed"])
        await col.wait_for(
            lambda: bool(col.stats) and col.stats[-1].num_aborted_requests == 1
            and col.stats[-1].num_running == 0 and col.stats[-1].num_waiting == 0
        )
        last = col.stats[-1]
        assert last.kv.num_free_blocks == last.kv.num_blocks == client.num_blocks
        assert last.kv.usage == 0.0
        assert len(col.tokens["long"]) < 200 and "long" not in col.finish
        assert col.dead == []
        return col

    asyncio.run(run())
    client.shutdown()
    assert not _alive(pid)
    assert not os.path.exists(ipc_dir)
    with pytest.raises(EngineDeadError):
        client.add_request(_request("late", [1], max_tokens=1))
    client.shutdown()  # idempotent


@pytest.mark.timeout(300)  # a hang, not a speed limit
def test_startup_error_is_raised_with_the_message():
    # Classified by the kind the handshake carries, not by the exception's class name.
    with pytest.raises(EngineConfigError, match="--kv-cache-memory"):
        EngineCoreClient(_config(kv_cache_memory=1))


def test_process_death_is_detected_without_traffic():
    client = EngineCoreClient(_config())

    async def run() -> None:
        col = Collector()
        client.start(col.on_outputs, col.on_stats, col.on_dead)
        client.add_request(_request("a", [5, 6, 7], max_tokens=200, ignore_eos=True))
        await col.wait_for(lambda: bool(col.tokens.get("a")))
        os.kill(client.pid, signal.SIGKILL)
        # No request is sent after the kill: only the process sentinel can bring the news.
        await col.wait_for(lambda: bool(col.dead), timeout_s=60)
        assert col.dead == ["engine core process died (killed by SIGKILL)"]
        assert client.dead_reason == col.dead[0]
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            client.add_request(_request("b", [1], max_tokens=1))
        client.abort_requests(["a"])  # no error on a dead engine

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
    assert not os.path.exists(client._ipc_dir)


def test_engine_exits_when_its_parent_dies():
    """No orphans: SIGKILL the process that owns the client; the engine core follows."""
    script = textwrap.dedent(f"""
        import sys, time
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.core_client import EngineCoreClient
        cfg = EngineArgs(model={MODEL!r}, max_model_len={MAX_MODEL_LEN}).create_engine_config()
        client = EngineCoreClient(cfg)
        print(client.pid, client._ipc_dir, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[3])
    try:
        line = parent.stdout.readline().split()
        assert len(line) == 2 and line[0].isdigit(), line
        core_pid, ipc_dir = int(line[0]), line[1]
        assert _alive(core_pid) and os.path.isdir(ipc_dir)
        parent.kill()
        parent.wait(10)
        assert wait_until(lambda: not _alive(core_pid))
        # The engine cleaned up the socket files its dead parent could not.
        assert wait_until(lambda: not os.path.exists(ipc_dir))
    finally:
        parent.kill()


@pytest.mark.timeout(120)
def test_a_killed_engine_core_leaves_no_worker_socket_directory(tmp_path, monkeypatch) -> None:
    """Shutdown that has to SIGKILL a stuck engine core (its mp executor never cleans up)
    still removes the executor's socket directory."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR here and in the child
    client = EngineCoreClient(_config(distributed_executor_backend="mp"))
    pid = client.proc.pid

    def made() -> list[Path]:
        # In $TMPDIR, or in /tmp when $TMPDIR is too long for socket paths.
        prefix = ipc_dir_prefix(pid)
        return list(tmp_path.glob(prefix + "*")) + list(Path("/tmp").glob(prefix + "*"))

    assert made(), "the mp executor made no socket directory"
    os.kill(pid, signal.SIGSTOP)  # stuck: it can neither answer nor clean up
    try:
        client.shutdown(timeout_s=1.0)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not made()
