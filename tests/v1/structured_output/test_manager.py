"""StructuredOutputManager: background compiles on two lanes, failures, timeouts that count only
the compile, batch bitmasks, cleanup."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from vllm.config import StructuredOutputsConfig
from vllm.exceptions import UnsupportedConstraintError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output.backends.auto import AutoBackend
from vllm.v1.structured_output.manager import StructuredOutputManager

from .conftest import VOCAB_SIZE
from .manager_utils import (
    MAX_NUM_SEQS,
    big_regex,
    block_big,
    make_config,
    make_request,
    manager_sharing,
    modules_loaded_by,
    wait_ready,
)
from .schemas import ALL_CASES
from .walker import WalkVocab, allowed_token_ids, random_walk


def test_compiles_in_background_and_clears(manager: StructuredOutputManager) -> None:
    request = make_request("bg", json={"type": "object", "properties": {"a": {"type": "integer"}}})
    assert request.status == RequestStatus.WAITING_FOR_FSM
    live = manager.num_live_grammars
    manager.grammar_init(request)
    manager.grammar_init(request)  # a second call does not submit again
    assert manager.num_live_grammars == live + 1
    assert wait_ready(request)
    assert request.structured_output_request.grammar is not None
    manager.clear(request)
    manager.clear(request)
    assert manager.num_live_grammars == live
    assert request.structured_output_request.grammar is None

    plain = make_request("plain")
    manager.grammar_init(plain)
    manager.clear(plain)
    assert manager.num_live_grammars == live


def test_compile_error_fails_only_that_request(manager: StructuredOutputManager) -> None:
    bad = make_request("bad", json={"type": "object", "properties": {"x": {"type": "foo"}}})
    good = make_request("good", regex="[0-9]{3}")
    manager.grammar_init(bad)
    manager.grammar_init(good)
    assert not wait_ready(bad)
    assert wait_ready(good)
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
    slow = make_request("slow", regex="slow")
    fast = make_request("fast", choice=["x", "y"])
    manager.grammar_init(slow)
    manager.grammar_init(fast)
    try:
        assert not wait_ready(slow, timeout_s=0.1)
        assert "took longer than 0.1 s" in slow.structured_output_request.error
        # A generous limit: the fast compile only has to be unaffected by the slow one.
        assert wait_ready(fast, timeout_s=60.0)
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
    manager = StructuredOutputManager(make_config(demo_dir, compile_timeout_s=0.3))

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
        requests.append(make_request("fallback", regex="fallback"))
    requests += [make_request(f"plain{i}", choice=["x", str(i)]) for i in range(3)]
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
        request = make_request(f"r{i}", **case.params)
        requests[request.request_id] = request
        manager.grammar_init(request)
    for req_id, request in requests.items():
        assert wait_ready(request), request.structured_output_request.error
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
        request = make_request(f"d{i}", **case.params)
        requests[request.request_id] = request
        manager.grammar_init(request)
        assert wait_ready(request), request.structured_output_request.error
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
    # Fast-forward tokens (certain drafts) have no row: the first row is the mask after them.
    skipped = manager.grammar_bitmask(requests, [victim], {victim: good}, {victim: 1})
    assert skipped.shape[0] == 1
    assert np.array_equal(skipped[0], exact[1])
    assert grammar.num_processed_tokens == before[victim]
    for request in requests.values():
        manager.clear(request)


def test_bitmask_buffers_rotate(manager: StructuredOutputManager) -> None:
    request = make_request("rot", choice=["a", "b"])
    manager.grammar_init(request)
    assert wait_ready(request)
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
    pending = make_request("pending", regex="a+")
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


def test_engine_option_and_shutdown(demo_dir: Path, tokenizer: Any) -> None:
    manager = StructuredOutputManager(make_config(demo_dir, disable_any_whitespace=True), tokenizer)
    done = make_request("done", json={"type": "object"})
    manager.grammar_init(done)
    assert wait_ready(done)
    # The engine-wide option makes JSON compact.
    grammar = done.structured_output_request.grammar
    assert grammar.accept_tokens("done", tokenizer.encode("{", add_special_tokens=False))
    bitmask = manager.grammar_bitmask({"done": done}, ["done"])
    assert not {220, 198, 197} & set(allowed_token_ids(bitmask[0], VOCAB_SIZE).tolist())
    queued = [
        make_request(f"q{i}", json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
        for i in range(6)
    ]
    for request in queued:
        manager.grammar_init(request)
    manager.shutdown()
    assert manager.num_live_grammars == 0
    assert done.structured_output_request.grammar is None
    with pytest.raises(RuntimeError, match="shutdown"):
        manager.grammar_init(make_request("late", regex="a"))


def test_without_tokenizer_loads_it_from_the_model(demo_dir: Path) -> None:
    manager = StructuredOutputManager(make_config(demo_dir), tokenizer=None)
    request = make_request("lazy", regex="a")
    manager.grammar_init(request)
    assert wait_ready(request)
    manager.clear(request)
    manager.shutdown()


def test_unloadable_tokenizer_fails_requests_cleanly(demo_dir: Path, tmp_path: Path) -> None:
    config = make_config(demo_dir)
    config.model_config.tokenizer = str(tmp_path / "missing")
    manager = StructuredOutputManager(config, tokenizer=None)
    request = make_request("notok", regex="a")
    manager.grammar_init(request)
    assert not wait_ready(request)
    assert "tokenizer" in request.structured_output_request.error
    manager.clear(request)
    assert manager.num_live_grammars == 0
    manager.shutdown()


def test_importing_the_manager_does_not_import_xgrammar() -> None:
    code = "import vllm.v1.structured_output.manager, vllm.v1.structured_output.request"
    assert modules_loaded_by(code, ["xgrammar"]) == []


def test_small_constraints_do_not_wait_behind_big_ones(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = manager_sharing(backend, demo_dir, compile_workers=2)
    release = block_big(monkeypatch, manager)
    try:
        big = [make_request(f"big{i}", regex=big_regex(f"blocked{i}")) for i in range(3)]
        for request in big:
            manager.grammar_init(request)
        small = make_request("small", choice=["yes", "no"])
        manager.grammar_init(small)
        # Every big-lane thread is stuck, yet the choice compiles.
        assert wait_ready(small)
        assert not any(r.structured_output_request.poll(60.0) for r in big)
        release.set()
        assert all(wait_ready(r, timeout_s=60.0) for r in big)
    finally:
        release.set()
        manager.shutdown()


def test_engine_compile_timeout_counts_only_the_compile(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = manager_sharing(backend, demo_dir, compile_workers=1)
    release = block_big(monkeypatch, manager)
    try:
        stuck = make_request("stuck", regex=big_regex("blocked"))
        queued = make_request("queued", regex=big_regex("fine"))
        manager.grammar_init(stuck)
        manager.grammar_init(queued)
        time.sleep(0.6)  # queued behind the stuck compile for longer than the limit below
        assert not queued.structured_output_request.poll(0.3)
        assert not queued.structured_output_request.failed
        release.set()
        assert wait_ready(queued, timeout_s=60.0)
        assert wait_ready(stuck, timeout_s=60.0)
        for request in (stuck, queued):
            manager.clear(request)
    finally:
        release.set()
        manager.shutdown()


def test_lanes_follow_the_configured_worker_count(demo_dir: Path) -> None:
    manager = StructuredOutputManager(make_config(demo_dir, compile_workers=3))
    try:
        regexes = ("a", big_regex("b"))
        lanes = {manager._lanes.lane(StructuredOutputsParams(regex=r)) for r in regexes}
        assert len(lanes) == 2
        assert all(lane._max_workers == 3 for lane in lanes)
    finally:
        manager.shutdown()
    default = StructuredOutputsConfig().num_compile_workers
    assert default == max(2, min(8, len(os.sched_getaffinity(0)) // 2))
