"""ConstraintChecker: validation bounded by the compile time limit, remembered verdicts,
limits before any compile, and checks in killable processes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.v1.structured_output.conftest import (  # noqa: F401  (fixtures)
    backend,
    demo_dir,
    manager,
    tokenizer,
)
from tests.v1.structured_output.manager_utils import (
    big_regex,
    block_big,
    make_config,
    make_request,
    manager_sharing,
    wait_ready,
)
from vllm.exceptions import InvalidRequestError
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine.constraint_checker import ConstraintChecker
from vllm.v1.structured_output.compile_pool import CompileAbortedError
from vllm.v1.structured_output.manager import StructuredOutputManager


def _checker(
    manager: StructuredOutputManager, demo_dir: Path, **structured: Any  # noqa: F811
) -> ConstraintChecker:
    """A checker that compiles with `manager` (as the offline engine's does)."""
    return ConstraintChecker(make_config(demo_dir, **structured), grammars=manager)


def test_validate_then_engine_compile_hits_the_cache(
    manager: StructuredOutputManager, demo_dir: Path  # noqa: F811
) -> None:
    checker = _checker(manager, demo_dir)
    schema = {"type": "object", "properties": {"unique_to_validate": {"type": "boolean"}}}
    cache = manager.backend.backend_named("xgrammar").compiler
    before = cache.get_cache_size_bytes()
    checker.validate(StructuredOutputsParams(json=schema))
    after_validate = cache.get_cache_size_bytes()
    assert after_validate > before  # a new schema is compiled and cached
    request = make_request("cached", json=schema)
    manager.grammar_init(request)
    assert wait_ready(request)
    assert cache.get_cache_size_bytes() == after_validate
    manager.clear(request)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        checker.validate(StructuredOutputsParams(regex="(a"))


@pytest.mark.parametrize("server, refused", [
    ("off", ["exact", "canonical"]), ("exact", ["canonical"]), ("canonical", [])])
def test_a_request_may_not_ask_for_more_fast_forward_than_the_server(
    manager: StructuredOutputManager, demo_dir: Path, server: str, refused: list  # noqa: F811
) -> None:
    checker = _checker(manager, demo_dir, fast_forward=server)
    for mode in ("off", "exact", "canonical"):
        params = StructuredOutputsParams(regex="[ab]", fast_forward=mode)
        if mode in refused:
            # Both entry points refuse it before anything compiles, naming the field.
            for check in (checker.validate, checker.check):
                with pytest.raises(InvalidRequestError, match="not enabled on this server") as e:
                    check(params)
                assert e.value.param == "structured_outputs.fast_forward"
        else:
            checker.validate(params)


def test_validate_is_bounded_by_the_timeout(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = manager_sharing(backend, demo_dir, compile_timeout_s=0.3)
    checker = _checker(manager, demo_dir, compile_timeout_s=0.3)
    release = block_big(monkeypatch, manager)
    try:
        with ThreadPoolExecutor(1) as caller:
            # The offline path (LLM.generate) validates on the caller's thread.
            call = caller.submit(checker.validate, StructuredOutputsParams(regex="blocked"))
            with pytest.raises(CompileAbortedError, match="took longer than 0.3 s"):
                call.result(timeout=60)
            release.set()
        # A timeout is not remembered as the constraint's verdict: it depends on the load.
        checker.validate(StructuredOutputsParams(regex="blocked"))
    finally:
        release.set()
        manager.shutdown()


def test_validate_counts_only_the_compile(
    demo_dir: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = manager_sharing(backend, demo_dir, compile_timeout_s=0.3, compile_workers=1)
    checker = _checker(manager, demo_dir, compile_timeout_s=0.3, compile_workers=1)
    release = block_big(monkeypatch, manager)
    try:
        stuck = make_request("stuck", regex=big_regex("blocked"))
        manager.grammar_init(stuck)
        with ThreadPoolExecutor(1) as caller:
            call = caller.submit(checker.validate, StructuredOutputsParams(regex=big_regex("q")))
            # It waits behind the stuck compile for longer than the limit ...
            time.sleep(0.6)
            assert not call.done()
            release.set()
            # ... and still passes: only its own compile counts.
            call.result(timeout=60)
        assert wait_ready(stuck, timeout_s=60.0)
        manager.clear(stuck)
    finally:
        release.set()
        manager.shutdown()


def test_validate_remembers_verdicts(
    manager: StructuredOutputManager, demo_dir: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    checker = _checker(manager, demo_dir)
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
        checker.validate(good)
        with pytest.raises(ValueError, match="rule 'root' can never finish"):
            checker.validate(bad)
    assert calls == ["json", "grammar"]
    # Key order does not make a different constraint.
    checker.validate(StructuredOutputsParams(json=dict(reversed(list(good.json.items())))))
    assert calls == ["json", "grammar"]


def test_validate_applies_the_limits(demo_dir: Path) -> None:  # noqa: F811
    checker = ConstraintChecker(make_config(demo_dir, max_enum_values=3))
    try:
        with pytest.raises(ValueError, match=r"max_enum_values"):
            checker.validate(StructuredOutputsParams(choice=["a", "b", "c", "d"]))
        assert checker._grammars._backend is None  # rejected before anything compiled
    finally:
        checker.shutdown()


def test_unloadable_tokenizer_fails_checks_cleanly(
    demo_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    config = make_config(demo_dir)
    config.model_config.tokenizer = str(tmp_path / "missing")
    checker = ConstraintChecker(config)
    with pytest.raises(ValueError, match="tokenizer"):
        checker.validate(StructuredOutputsParams(regex="a"))
    checker.shutdown()


# A schema that passes the default limits (8,000 values, 255,000 characters) yet takes
# xgrammar 0.2.9 about a minute to compile.
SLOW_SCHEMA = {"enum": [f"item number {i} of the list" for i in range(8000)]}


def test_checks_in_processes_kill_slow_compiles(demo_dir: Path) -> None:  # noqa: F811
    checker = ConstraintChecker(make_config(demo_dir, compile_timeout_s=1.0))
    try:
        assert checker.check(StructuredOutputsParams(choice=["a", "b"])).result(120) >= 0.0
        slow = [
            checker.check(StructuredOutputsParams(json=SLOW_SCHEMA, disable_any_whitespace=w))
            for w in (False, True)
        ]
        quick = [checker.check(StructuredOutputsParams(choice=["x", str(i)])) for i in range(3)]
        for future in quick:
            assert future.result(60) >= 0.0
        for future in slow:
            with pytest.raises(CompileAbortedError, match="took longer than 1 s"):
                future.result(60)
        with pytest.raises(ValueError, match="'anyOf' is an empty list"):
            checker.check(StructuredOutputsParams(json={"anyOf": []})).result(60)
        # The processor's own validate is then a lookup: nothing compiles in this process.
        checker.validate(StructuredOutputsParams(choice=["x", "0"]))
        with pytest.raises(ValueError, match="'anyOf' is an empty list"):
            checker.validate(StructuredOutputsParams(json={"anyOf": []}))
        assert checker._grammars._backend is None
        with pytest.raises(ValueError, match="max_json_depth"):
            checker.check(StructuredOutputsParams(json="[" * 200 + "]" * 200))
    finally:
        checker.shutdown()
