"""Check the structured-output backends against jsonschema on generated schemas, at scale.

    .venv/bin/python scripts/differential_check.py --schemas 10000 --seed 0 \
        --backends xgrammar,guidance,outlines,lm-format-enforcer --out findings.json

For each backend: how many schemas it accepted, how many instances were compared, and the
disagreements by kind (see tests/v1/structured_output/differential.py): accepted but invalid
("unsound"), valid but refused by a declared narrowing ("refused", by narrowing), refused by
none ("unexplained"), dead ends; every finding is written to --out. The exit status is 1
when any backend accepted a value jsonschema refuses or refused one unexplained.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.v1.structured_output.differential import Checker, Tally  # noqa: E402
from tests.v1.structured_output.schema_gen import schemas  # noqa: E402
from tests.v1.structured_output.walker import WalkVocab, token_bytes  # noqa: E402

MODEL = "demo-small-vocab"


def make_checkers(names: list[str]) -> list[Checker]:
    """One checker per backend name, over the small demo vocabulary (fast to compile)."""
    from vllm.config import StructuredOutputsConfig
    from vllm.model_executor.model_loader.demos import resolve_model_dir
    from vllm.transformers_utils.tokenizer import get_tokenizer
    from vllm.v1.structured_output.backends.auto import create_backend

    model_dir = resolve_model_dir(MODEL)
    tokenizer = get_tokenizer(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab_size = config["vocab_size"]
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = WalkVocab.build(token_bytes(tokenizer), vocab_size, [eos_id])
    return [
        Checker(name, create_backend(StructuredOutputsConfig(backend=name), tokenizer,
                                     vocab_size, [eos_id]), tokenizer, vocab, eos_id)
        for name in names
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemas", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default="xgrammar,guidance,outlines,lm-format-enforcer")
    parser.add_argument("--out", type=Path, default=Path("differential_findings.json"))
    args = parser.parse_args(argv)
    checkers = make_checkers(args.backends.split(","))
    generated = schemas(args.seed, args.schemas)
    report, findings, unsound = {}, [], 0
    for checker in checkers:
        tally, start = Tally(), time.monotonic()
        rng = random.Random(args.seed)
        for schema in generated:
            checker.check(schema, rng, tally)
        report[checker.name] = {
            "schemas": tally.schemas, "accepted": tally.accepted,
            "instances": tally.instances, "unsound": tally.count("unsound"),
            "refused": tally.count("refused"), "unexplained": tally.count("unexplained"),
            "dead_ends": tally.count("dead end"),
            "refused_by": dict(Counter(f.detail for f in tally.findings
                                       if f.kind == "refused").most_common()),
            "seconds": round(time.monotonic() - start, 1),
        }
        unsound += tally.count("unsound") + tally.count("unexplained")
        findings += [f.to_json() for f in tally.findings]
        print(checker.name, json.dumps(report[checker.name]), flush=True)
    args.out.write_text(json.dumps({"report": report, "findings": findings}, indent=1))
    return 1 if unsound else 0


if __name__ == "__main__":
    raise SystemExit(main())
