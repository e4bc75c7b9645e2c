"""A request that names its structured-output backend (StructuredOutputsParams.backend, the
server's structured_outputs.backend / guided_decoding_backend) gets that backend or a clear
error, never the other backend silently."""

from __future__ import annotations

import pytest

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
    # xgrammar cannot bound a pattern's length; auto would hand it to llguidance.
    schema = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 6}
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
