"""StructuredOutputManager: background compiles on two lanes, failures, timeouts that count only
the compile, bounded validation, checks in killable processes, batch bitmasks, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm.config import ModelConfig, SchedulerConfig, StructuredOutputsConfig, VllmConfig
from vllm.exceptions import UnsupportedConstraintError
from vllm.sampling_params import SamplingParams, StructuredOutputsParams
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output.backend_auto import AutoBackend
from vllm.v1.structured_output import CompileAbortedError, StructuredOutputManager
from vllm.v1.structured_output.limits import SMALL_CONSTRAINT_LENGTH

from .conftest import VOCAB_SIZE
from .schemas import ALL_CASES
from .walker import WalkVocab, allowed_token_ids, random_walk

MAX_NUM_SEQS = 96


def _config(demo_dir: Path, **structured: Any) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(model=str(demo_dir)),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS),
        structured_outputs_config=StructuredOutputsConfig(**structured),
    )


@pytest.fixture(scope="module")
def manager(demo_dir: Path, tokenizer: Any) -> StructuredOutputManager:
    manager = StructuredOutputManager(_config(demo_dir), tokenizer)
    yield manager
    manager.shutdown()


def _manager_sharing(backend: Any, demo_dir: Path, **structured: Any) -> StructuredOutputManager:
    """A manager with its own config that reuses the session's backend (building one takes
    seconds). Its shutdown only clears the backend's cache."""
    manager = StructuredOutputManager(_config(demo_dir, **structured))
    manager._backend = AutoBackend(backend.vocab_size, [("xgrammar", lambda: backend)])
    return manager


def _request(req_id: str, **constraint: Any) -> Request:
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(**constraint) if constraint else None
    )
    return Request(req_id, [1, 2, 3], params)


def _wait(request: Request, timeout_s: float = 10.0, deadline_s: float = 60.0) -> bool:
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


def test_compiles_in_background_and_clears(manager: StructuredOutputManager) -> None:
    request = _request("bg", json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert request.status == RequestStatus.WAITING_FOR_FSM
    live = manager.num_live_grammars
    manager.grammar_init(request)
    manager.grammar_init(request)  # a second call does not submit again
    assert manager.num_live_grammars == live + 1
    assert _wait(request)
    assert request.structured_output_request.grammar is not None
    manager.clear(request)
    manager.clear(request)
    assert manager.num_live_grammars == live
    assert request.structured_output_request.grammar is None

    plain = _request("plain")
    manager.grammar_init(plain)
    manager.clear(plain)
    assert manager.num_live_grammars == live


def test_compile_error_fails_only_that_request(manager: StructuredOutputManager) -> None:
    bad = _request("bad", json={"type": "object", "properties": {"x": {"type": "foo"}}})
    good = _request("good", regex="[0-9]{3}")
    manager.grammar_init(bad)
    manager.grammar_init(good)
    assert not _wait(bad)
    assert _wait(good)
    error = bad.structured_output_request.error
    assert error.startswith("structured_outputs.json") and "foo" in error
    assert bad.structured_output_request.failed and bad.structured_output_request.grammar is None
    manager.clear(bad)
    manager.clear(good)


def test_compile_timeout_fails_only_that_request(
    manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = manager.backend
    compile_choosing = backend.compile_choosing
    # The slow compile ends only when the test lets it (after its deadline), however fast
    # or slow the machine is.
    release, finished = threading.Event(), threading.Event()

    def slow_for_one(params: StructuredOutputsParams, **kwargs: Any) -> Any:
        if params.regex != "slow":
            return compile_choosing(params, **kwargs)
        release.wait(60)
        try:
            return compile_choosing(params, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(backend, "compile_choosing", slow_for_one)
    slow = _request("slow", regex="slow")
    fast = _request("fast", choice=["x", "y"])
    manager.grammar_init(slow)
    manager.grammar_init(fast)
    try:
        assert not _wait(slow, timeout_s=0.1)
        assert "took longer than 0.1 s" in slow.structured_output_request.error
        # A generous limit: the fast compile only has to be unaffected by the slow one.
        assert _wait(fast, timeout_s=60.0)
    finally:
        release.set()
    assert finished.wait(60)  # the abandoned compile finished; it must not revive the request
    assert not slow.structured_output_request.poll(0.1)
    assert slow.structured_output_request.grammar is None
    manager.clear(slow)
    manager.clear(fast)


class _RefusesFallbackRegex:
    """A backend that refuses regex "fallback" (sends it to the next backend)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        if params.regex == "fallback":
            raise UnsupportedConstraintError("structured_outputs.regex", "not this one")
        return self.backend.compile_grammar(params)

    def destroy(self) -> None:
        pass


def _poll_all(requests: list[Request], timeout_s: float, deadline_s: float = 30.0) -> None:
    """Polls every request in turn, as the scheduler does, until none is pending; asserts
    that none failed."""
    end = time.monotonic() + deadline_s
    pending = list(requests)
    while pending and time.monotonic() < end:
        for request in list(pending):
            structured_req = request.structured_output_request
            if structured_req.poll(timeout_s):
                pending.remove(request)
            else:
                assert not structured_req.failed, structured_req.error
        time.sleep(0.002)
    assert not pending, "compiles neither ready nor failed"


@pytest.mark.parametrize("slow", ["first", "fallback"])
def test_building_a_backend_is_no_requests_compile_time(
    backend: Any, demo_dir: Path, slow: str
) -> None:
    """The first structured requests of an engine wait while a backend is built (seconds, on
    a busy machine more than a short time limit): that wait must not fail them, nor requests
    whose own backend is built while a fallback backend is being built."""
    manager = StructuredOutputManager(_config(demo_dir, compile_timeout_s=0.3))

    def build(result: Any, seconds: float) -> Callable[[], Any]:
        def built() -> Any:
            time.sleep(seconds)
            return result

        return built

    first = _RefusesFallbackRegex(backend)
    first_s, next_s = (0.8, 0.0) if slow == "first" else (0.0, 0.8)
    factories = [("first", build(first, first_s)), ("next", build(backend, next_s))]
    manager._backend = AutoBackend(backend.vocab_size, factories)
    requests = []
    if slow == "fallback":
        manager._backend.backend_named("first")  # built: only the fallback's build is slow
        requests.append(_request("fallback", regex="fallback"))
    requests += [_request(f"plain{i}", choice=["x", str(i)]) for i in range(3)]
    try:
        for request in requests:
            manager.grammar_init(request)
            time.sleep(0.05)  # the fallback's build has started before the others compile
        _poll_all(requests, timeout_s=0.3)
    finally:
        for request in requests:
            manager.clear(request)
        manager.shutdown()


def test_batch_bitmask_matches_fresh_replays(
    manager: StructuredOutputManager, walk_vocab: WalkVocab
) -> None:
    rng = np.random.default_rng(7)
    requests: dict[str, Request] = {}
    histories: dict[str, list[int]] = {}
    for i in range(MAX_NUM_SEQS):
        case = ALL_CASES[(i * 7) % len(ALL_CASES)]
        request = _request(f"r{i}", **case.params)
        requests[request.request_id] = request
        manager.grammar_init(request)
    for req_id, request in requests.items():
        assert _wait(request), request.structured_output_request.error
        grammar = request.structured_output_request.grammar
        # Advance some requests to the end (terminated) and others part of the way.
        tokens, _ = random_walk(
            grammar,
            walk_vocab,
            rng,
            max_steps=int(rng.integers(0, 6)) if rng.random() < 0.8 else 600,
        )
        histories[req_id] = tokens
    assert any(r.structured_output_request.grammar.is_terminated() for r in requests.values())

    order = list(requests)
    rng.shuffle(order)
    # With 64 or more live grammars the fill is multi-threaded; 20 rows take the serial path.
    assert (
        sum(not r.structured_output_request.grammar.is_terminated() for r in requests.values())
        >= 64
    )
    for ids in (order, order[:20]):
        bitmask = manager.grammar_bitmask(requests, ids)
        assert bitmask.shape == (len(ids), (VOCAB_SIZE + 31) // 32)
        assert bitmask.dtype == np.int32
        for row, req_id in enumerate(ids):
            grammar = requests[req_id].structured_output_request.grammar
            if grammar.is_terminated():
                assert (bitmask[row] == -1).all()
                continue
            params = requests[req_id].sampling_params.structured_outputs
            fresh = manager.backend.compile_grammar(params)
            assert fresh.accept_tokens("replay", histories[req_id])
            expected = np.zeros((1, bitmask.shape[1]), dtype=np.int32)
            fresh.fill_bitmask(expected, 0)
            assert np.array_equal(bitmask[row], expected[0]), req_id
            assert len(allowed_token_ids(bitmask[row], VOCAB_SIZE)) > 0
    for request in requests.values():
        manager.clear(request)


def test_bitmask_rows_for_drafts_match_fresh_replays(
    manager: StructuredOutputManager, walk_vocab: WalkVocab
) -> None:
    """Speculative decoding: a request with drafts gets a row per position, each the mask
    after the drafts before it; every grammar is left where it was."""
    rng = np.random.default_rng(11)
    requests: dict[str, Request] = {}
    histories: dict[str, list[int]] = {}
    drafts: dict[str, list[int]] = {}
    for i in range(12):
        case = ALL_CASES[(i * 5) % len(ALL_CASES)]
        request = _request(f"d{i}", **case.params)
        requests[request.request_id] = request
        manager.grammar_init(request)
        assert _wait(request), request.structured_output_request.error
        grammar = request.structured_output_request.grammar
        histories[request.request_id], _ = random_walk(
            grammar, walk_vocab, rng, max_steps=int(rng.integers(0, 4)))
        if i % 3:  # some requests have no drafts
            ahead, _ = random_walk(grammar, walk_vocab, rng, max_steps=int(rng.integers(1, 5)))
            grammar.rollback(len(ahead))
            drafts[request.request_id] = ahead
    ids = list(requests)
    before = {r: requests[r].structured_output_request.grammar.num_processed_tokens for r in ids}
    bitmask = manager.grammar_bitmask(requests, ids, drafts)
    assert bitmask.shape[0] == len(ids) + sum(len(d) for d in drafts.values())
    row = 0
    for req_id in ids:
        grammar = requests[req_id].structured_output_request.grammar
        assert grammar.num_processed_tokens == before[req_id]
        params = requests[req_id].sampling_params.structured_outputs
        ahead = drafts.get(req_id, [])
        for j in range(len(ahead) + 1):
            fresh = manager.backend.compile_grammar(params)
            assert fresh.accept_tokens("replay", histories[req_id] + ahead[:j])
            expected = np.zeros((1, bitmask.shape[1]), dtype=np.int32)
            fresh.fill_bitmask(expected, 0)
            assert np.array_equal(bitmask[row], expected[0]), (req_id, j)
            row += 1
    # A stale draft the grammar rejects (async drafting assumed tokens that did not come):
    # the rows up to it are exact, the rows after it allow everything, and the grammar is
    # still left as it was.
    victim = next(r for r in ids if drafts.get(r))
    grammar = requests[victim].structured_output_request.grammar
    good = drafts[victim][:1]
    grammar.accept_tokens(victim, good)
    bad = next(t for t in range(VOCAB_SIZE) if not grammar.validate_tokens([t]))
    grammar.rollback(1)
    exact = manager.grammar_bitmask(requests, [victim], {victim: good}).copy()
    stale = manager.grammar_bitmask(requests, [victim], {victim: good + [bad, good[0]]})
    assert np.array_equal(stale[:2], exact)
    assert (stale[2:] == -1).all()
    assert grammar.num_processed_tokens == before[victim]
    for request in requests.values():
        manager.clear(request)


def test_bitmask_buffers_rotate(manager: StructuredOutputManager) -> None:
    request = _request("rot", choice=["a", "b"])
    manager.grammar_init(request)
    assert _wait(request)
    reqs = {"rot": request}
    first = manager.grammar_bitmask(reqs, ["rot"])
    snapshot = first.copy()
    second = manager.grammar_bitmask(reqs, ["rot"])
    # Default (sync) config: the previous result stays intact through one more call.
    assert not np.shares_memory(first, second)
    assert np.array_equal(first, snapshot)
    assert manager.grammar_bitmask(reqs, []).shape == (0, first.shape[1])
    manager.clear(request)


def test_bitmask_rejects_bad_input(manager: StructuredOutputManager) -> None:
    pending = _request("pending", regex="a+")
    with pytest.raises(ValueError, match="no ready grammar"):
        manager.grammar_bitmask({"pending": pending}, ["pending"])
    with pytest.raises(ValueError, match="no ready grammar"):
        manager.grammar_bitmask({}, ["missing"])
    with pytest.raises(ValueError, match="max_num_seqs"):
        manager.grammar_bitmask({}, [f"x{i}" for i in range(MAX_NUM_SEQS + 1)])
    # Draft rows count too: each request with drafts needs 1 + len(drafts) rows.
    ids = [f"x{i}" for i in range(MAX_NUM_SEQS)]
    with pytest.raises(ValueError, match="max_num_seqs"):
        manager.grammar_bitmask({}, ids, {"x0": [1]})


def test_validate_then_engine_compile_hits_the_cache(manager: StructuredOutputManager) -> None:
    schema = {"type": "object", "properties": {"unique_to_validate": {"type": "boolean"}}}
    cache = manager.backend.backend_named("xgrammar").compiler
    before = cache.get_cache_size_bytes()
    manager.validate(StructuredOutputsParams(json=schema))
    after_validate = cache.get_cache_size_bytes()
    assert after_validate > before  # a new schema is compiled and cached
    request = _request("cached", json=schema)
    manager.grammar_init(request)
    assert _wait(request)
    assert cache.get_cache_size_bytes() == after_validate
    manager.clear(request)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        manager.validate(StructuredOutputsParams(regex="(a"))


def test_engine_option_and_shutdown(demo_dir: Path, tokenizer: Any) -> None:
    manager = StructuredOutputManager(_config(demo_dir, disable_any_whitespace=True), tokenizer)
    done = _request("done", json={"type": "object"})
    manager.grammar_init(done)
    assert _wait(done)
    # The engine-wide option makes JSON compact.
    grammar = done.structured_output_request.grammar
    assert grammar.accept_tokens("done", tokenizer.encode("{", add_special_tokens=False))
    bitmask = manager.grammar_bitmask({"done": done}, ["done"])
    assert not {220, 198, 197} & set(allowed_token_ids(bitmask[0], VOCAB_SIZE).tolist())
    queued = [
        _request(f"q{i}", json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
        for i in range(6)
    ]
    for request in queued:
        manager.grammar_init(request)
    manager.shutdown()
    assert manager.num_live_grammars == 0
    assert done.structured_output_request.grammar is None
    with pytest.raises(RuntimeError, match="shutdown"):
        manager.grammar_init(_request("late", regex="a"))


def test_without_tokenizer_loads_it_from_the_model(demo_dir: Path) -> None:
    manager = StructuredOutputManager(_config(demo_dir), tokenizer=None)
    request = _request("lazy", regex="a")
    manager.grammar_init(request)
    assert _wait(request)
    manager.clear(request)
    manager.shutdown()


def test_unloadable_tokenizer_fails_requests_cleanly(demo_dir: Path, tmp_path: Path) -> None:
    config = _config(demo_dir)
    config.model_config.tokenizer = str(tmp_path / "missing")
    manager = StructuredOutputManager(config, tokenizer=None)
    request = _request("notok", regex="a")
    manager.grammar_init(request)
    assert not _wait(request)
    assert "tokenizer" in request.structured_output_request.error
    with pytest.raises(ValueError, match="tokenizer"):
        manager.validate(StructuredOutputsParams(regex="a"))
    manager.clear(request)
    assert manager.num_live_grammars == 0
    manager.shutdown()


def test_importing_the_manager_does_not_import_xgrammar() -> None:
    code = (
        "import sys\n"
        "import vllm.v1.structured_output, vllm.v1.structured_output.request\n"
        "print('xgrammar' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
        timeout=120,
    )
    assert out.stdout.strip() == "False", out.stderr


def _big_regex(tag: str) -> str:
    # Longer than SMALL_CONSTRAINT_LENGTH: compiles on the big-constraint lane.
    return f"{tag}-" + "x" * (SMALL_CONSTRAINT_LENGTH + 1)


def _block_big(monkeypatch: pytest.MonkeyPatch, manager: StructuredOutputManager) -> Any:
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


def test_small_constraints_do_not_wait_behind_big_ones(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager_sharing(backend, demo_dir, compile_workers=2)
    release = _block_big(monkeypatch, manager)
    try:
        big = [_request(f"big{i}", regex=_big_regex(f"blocked{i}")) for i in range(3)]
        for request in big:
            manager.grammar_init(request)
        small = _request("small", choice=["yes", "no"])
        manager.grammar_init(small)
        # Every big-lane thread is stuck, yet the choice compiles.
        assert _wait(small)
        assert not any(r.structured_output_request.poll(60.0) for r in big)
        release.set()
        assert all(_wait(r, timeout_s=60.0) for r in big)
    finally:
        release.set()
        manager.shutdown()


def test_engine_compile_timeout_counts_only_the_compile(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager_sharing(backend, demo_dir, compile_workers=1)
    release = _block_big(monkeypatch, manager)
    try:
        stuck = _request("stuck", regex=_big_regex("blocked"))
        queued = _request("queued", regex=_big_regex("fine"))
        manager.grammar_init(stuck)
        manager.grammar_init(queued)
        time.sleep(0.6)  # queued behind the stuck compile for longer than the limit below
        assert not queued.structured_output_request.poll(0.3)
        assert not queued.structured_output_request.failed
        release.set()
        assert _wait(queued, timeout_s=60.0)
        assert _wait(stuck, timeout_s=60.0)
        for request in (stuck, queued):
            manager.clear(request)
    finally:
        release.set()
        manager.shutdown()


def test_lanes_follow_the_configured_worker_count(demo_dir: Path) -> None:
    manager = StructuredOutputManager(_config(demo_dir, compile_workers=3))
    try:
        lanes = {manager._lane(StructuredOutputsParams(regex=r)) for r in ("a", _big_regex("b"))}
        assert len(lanes) == 2
        assert all(lane._max_workers == 3 for lane in lanes)
    finally:
        manager.shutdown()
    default = StructuredOutputsConfig().num_compile_workers
    assert default == max(2, min(8, len(os.sched_getaffinity(0)) // 2))


def test_validate_is_bounded_by_the_timeout(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager_sharing(backend, demo_dir, compile_timeout_s=0.3)
    release = _block_big(monkeypatch, manager)
    try:
        with ThreadPoolExecutor(1) as caller:
            # The offline path (LLM.generate) validates on the caller's thread.
            call = caller.submit(manager.validate, StructuredOutputsParams(regex="blocked"))
            with pytest.raises(CompileAbortedError, match="took longer than 0.3 s"):
                call.result(timeout=60)
            release.set()
        # A timeout is not remembered as the constraint's verdict: it depends on the load.
        manager.validate(StructuredOutputsParams(regex="blocked"))
    finally:
        release.set()
        manager.shutdown()


def test_validate_counts_only_the_compile(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager_sharing(backend, demo_dir, compile_timeout_s=0.3, compile_workers=1)
    release = _block_big(monkeypatch, manager)
    try:
        stuck = _request("stuck", regex=_big_regex("blocked"))
        manager.grammar_init(stuck)
        with ThreadPoolExecutor(1) as caller:
            call = caller.submit(manager.validate, StructuredOutputsParams(regex=_big_regex("q")))
            # It waits behind the stuck compile for longer than the limit ...
            time.sleep(0.6)
            assert not call.done()
            release.set()
            # ... and still passes: only its own compile counts.
            call.result(timeout=60)
        assert _wait(stuck, timeout_s=60.0)
        manager.clear(stuck)
    finally:
        release.set()
        manager.shutdown()


def test_validate_remembers_verdicts(
    manager: StructuredOutputManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = manager.backend
    compile_choosing = backend.compile_choosing
    calls: list[str] = []

    def counting(params: StructuredOutputsParams, **kwargs: Any) -> Any:
        calls.append(params.kind)
        return compile_choosing(params, **kwargs)

    monkeypatch.setattr(backend, "compile_choosing", counting)
    good = StructuredOutputsParams(json={"type": "object", "properties": {"remember": {}}})
    bad = StructuredOutputsParams(grammar='root ::= root "z"')
    for _ in range(2):
        manager.validate(good)
        with pytest.raises(ValueError, match="rule 'root' can never finish"):
            manager.validate(bad)
    assert calls == ["json", "grammar"]
    # Key order does not make a different constraint.
    manager.validate(StructuredOutputsParams(json=dict(reversed(list(good.json.items())))))
    assert calls == ["json", "grammar"]


def test_validate_applies_the_limits(demo_dir: Path) -> None:
    manager = StructuredOutputManager(_config(demo_dir, max_enum_values=3))
    try:
        with pytest.raises(ValueError, match=r"max_enum_values"):
            manager.validate(StructuredOutputsParams(choice=["a", "b", "c", "d"]))
        assert manager._backend is None  # rejected before anything compiled
    finally:
        manager.shutdown()


# A schema that passes the default limits (8,000 values, 255,000 characters) yet takes
# xgrammar 0.2.9 about a minute to compile.
SLOW_SCHEMA = {"enum": [f"item number {i} of the list" for i in range(8000)]}


def test_checks_in_processes_kill_slow_compiles(demo_dir: Path) -> None:
    manager = StructuredOutputManager(
        _config(demo_dir, compile_timeout_s=1.0), None, check_in_processes=True
    )
    try:
        assert manager.check(StructuredOutputsParams(choice=["a", "b"])).result(120) >= 0.0
        slow = [
            manager.check(StructuredOutputsParams(json=SLOW_SCHEMA, disable_any_whitespace=w))
            for w in (False, True)
        ]
        quick = [manager.check(StructuredOutputsParams(choice=["x", str(i)])) for i in range(3)]
        for future in quick:
            assert future.result(60) >= 0.0
        for future in slow:
            with pytest.raises(CompileAbortedError, match="took longer than 1 s"):
                future.result(60)
        with pytest.raises(ValueError, match="'anyOf' is an empty list"):
            manager.check(StructuredOutputsParams(json={"anyOf": []})).result(60)
        # The processor's own validate is then a lookup: nothing compiles in this process.
        manager.validate(StructuredOutputsParams(choice=["x", "0"]))
        with pytest.raises(ValueError, match="'anyOf' is an empty list"):
            manager.validate(StructuredOutputsParams(json={"anyOf": []}))
        assert manager._backend is None
        with pytest.raises(ValueError, match="max_json_depth"):
            manager.check(StructuredOutputsParams(json="[" * 200 + "]" * 200))
    finally:
        manager.shutdown()
