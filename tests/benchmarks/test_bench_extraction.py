"""bench_extraction: its cases know their answers, its scoring counts what it says, and a
whole run on the tiny demo model produces the table (the figures belong to the real model;
see the README)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema

from tests.benchmarks.scripts import REPO, load_script

bench = load_script("bench_extraction")


def test_every_truth_satisfies_its_schema_and_is_in_its_sentence() -> None:
    cases = bench.make_cases(5, seed=3)
    assert len(cases) == 15 and cases == bench.make_cases(5, seed=3)
    for kind, sentence, truth in cases:
        jsonschema.validate(truth, bench.SCHEMAS[kind])
        for value in truth.values():
            assert str(value) in sentence


def test_scoring() -> None:
    truth = {"name": "Chen Wei", "age": 40, "city": "Lima"}
    assert bench.score("person", {"name": " chen wei", "age": 40, "city": "Oslo"}, truth) == (
        True, 2)
    assert bench.score("person", {"name": "Chen Wei", "age": "40", "city": "Lima"}, truth) == (
        False, 0)
    assert bench.score("person", None, truth) == (False, 0)
    text = 'Sure! {"a": 1, "b": [2]} and {"c": 3}'
    assert bench.first_json_object(text) == {"a": 1, "b": [2]}
    assert bench.first_json_object("no json {here") is None


def test_a_run_prints_the_table(tmp_path) -> None:
    out = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_extraction.py"), "--model",
         "demo-tiny", "--per-kind", "1", "--max-tokens", "8", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "field accuracy, enforced - free" in proc.stdout
    data = json.loads(out.read_text())
    assert data["enforced"]["kinds"]["all"]["n"] == 3
