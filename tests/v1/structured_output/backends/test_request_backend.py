"""A request that names its structured-output backend (StructuredOutputsParams.backend, the
server's structured_outputs.backend / guided_decoding_backend) gets that backend or a clear
error, never the other backend silently."""

from __future__ import annotations

import pytest

from tests.v1.structured_output.oracle import check_structured_output
from vllm import LLM, SamplingParams, StructuredOutputsParams
from vllm.exceptions import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    engine = LLM("demo-tiny", max_model_len=256, max_num_seqs=8)
    yield engine
    engine.shutdown()


def _choices(llm: LLM) -> dict[str, int]:
    counts: dict[str, int] = {}
    for (name, _), n in llm.llm_engine.engine_core.structured_output_manager.backend_choices().items():
        counts[name] = counts.get(name, 0) + n
    return counts


@pytest.mark.parametrize("backend", ["guidance", "llguidance", "xgrammar"])
def test_the_named_backend_compiles_the_request(llm, backend) -> None:
    before = _choices(llm)
    so = StructuredOutputsParams(regex="[a-c]{3}", backend=backend)
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=so),
                          use_tqdm=False)
    assert len(out.outputs[0].text) == 3 and set(out.outputs[0].text) <= set("abc")
    after = _choices(llm)
    want = "guidance" if backend != "xgrammar" else "xgrammar"
    assert after.get(want, 0) == before.get(want, 0) + 1
    other = "xgrammar" if want == "guidance" else "guidance"
    assert after.get(other, 0) == before.get(other, 0)


def test_a_backend_that_cannot_enforce_the_constraint_is_not_replaced(llm) -> None:
    # xgrammar cannot bound the length of a pattern with a group; auto would hand it to
    # llguidance.
    schema = {"type": "string", "pattern": "^([a-z]b)+$", "maxLength": 6}
    with pytest.raises(InvalidRequestError, match="xgrammar|maxLength|pattern"):
        llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
            json=schema, backend="xgrammar")), use_tqdm=False)
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json=schema)), use_tqdm=False)
    assert out.outputs[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("name", ["bogus", "lm_format_enforcer", ""])
def test_unknown_backends_are_named(name) -> None:
    with pytest.raises(InvalidRequestError, match="structured_outputs.backend"):
        StructuredOutputsParams(regex="a", backend=name)


@pytest.fixture(scope="module")
def async_llm():
    engine = LLM("demo-tiny", max_model_len=256, max_num_seqs=8, async_scheduling=True)
    yield engine
    engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["outlines", "lm-format-enforcer"])
def test_compatibility_backends_under_async_scheduling(async_llm, backend) -> None:
    """Upstream's other backend names work per request on an `auto` server with async
    scheduling (the grammar advances one step late there), and every output passes the
    oracle; a constraint kind the backend has no words for is refused, naming it."""
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                             "ok": {"type": "boolean"}},
              "required": ["name", "ok"]}
    constraints = [{"json": schema, "disable_any_whitespace": True},
                   {"regex": "[a-c]{2,4}-[0-9]{1,2}"}, {"choice": ["red", "green"]}]
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(**c, backend=backend))
              for c in constraints for seed in (1, 2)]
    before = _choices(async_llm)
    outputs = async_llm.generate(["x"] * len(params), params, use_tqdm=False)
    tokenizer = async_llm.get_tokenizer()
    stopped = 0
    for p, out in zip(params, outputs):
        completion = out.outputs[0]
        check_structured_output(p.structured_outputs, completion, tokenizer)
        stopped += completion.finish_reason == "stop"
    assert stopped >= len(params) - 2, [o.outputs[0].text for o in outputs]
    assert _choices(async_llm).get(backend, 0) == before.get(backend, 0) + len(params)
    with pytest.raises(InvalidRequestError, match=f"structured_outputs.grammar.*{backend}"):
        async_llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=(
            StructuredOutputsParams(grammar='root ::= "a"', backend=backend))), use_tqdm=False)
