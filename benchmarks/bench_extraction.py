"""Extraction accuracy: does enforcing a JSON schema make a real model better or worse?

    .venv/bin/python benchmarks/bench_extraction.py [--model smollm2] [--per-kind 20] \
        [--json results/extraction.json] [--no-async-scheduling]

Sentences state facts about people, orders and events (generated from a seeded list of
names, cities, items and dates, so every sentence has a known answer). Each is sent twice,
greedy, with a system prompt that asks for the facts as JSON with named keys:
- enforced: with the kind's JSON schema as a structured output;
- free: without one, the first JSON object of the answer parsed afterwards.
Prints, per kind and overall: valid (the output parses and satisfies the schema), field
accuracy (fields equal to the truth, case and surrounding spaces ignored, over all fields
of all sentences: an invalid output scores 0 for each of its fields), and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import jsonschema

from vllm import LLM, SamplingParams, StructuredOutputsParams

NAMES = ["Alice Martin", "Bruno Costa", "Chen Wei", "Dana Levi", "Erik Berg", "Fatima Noor",
         "Hugo Blanc", "Ines Duarte", "Jonas Weber", "Kenji Sato", "Laura Rossi",
         "Mateo Ruiz", "Nora Olsen", "Omar Haddad", "Priya Shah", "Sofia Novak"]
CITIES = ["Paris", "Tokyo", "Lima", "Berlin", "Cairo", "Toronto", "Madrid", "Oslo", "Seoul",
          "Dublin", "Nairobi", "Lisbon"]
ITEMS = ["chairs", "lamps", "notebooks", "bicycles", "kettles", "umbrellas", "guitars",
         "printers"]
EVENTS = ["concert", "conference", "marathon", "book fair", "film festival", "wedding"]
MONTHS = ["January", "March", "May", "July", "September", "November"]

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "city": {"type": "string"}},
        "required": ["name", "age", "city"], "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {"customer": {"type": "string"}, "quantity": {"type": "integer"},
                       "item": {"type": "string"}},
        "required": ["customer", "quantity", "item"], "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {"event": {"type": "string"}, "city": {"type": "string"},
                       "month": {"type": "string"}, "day": {"type": "integer"}},
        "required": ["event", "city", "month", "day"], "additionalProperties": False,
    },
}


def make_cases(per_kind: int, seed: int = 0) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, sentence, truth) for per_kind sentences of each kind, from a seeded RNG."""
    rng = random.Random(seed)
    cases = []
    for _ in range(per_kind):
        name, city, age = rng.choice(NAMES), rng.choice(CITIES), rng.randint(19, 85)
        cases.append(("person", f"{name} is {age} years old and lives in {city}.",
                      {"name": name, "age": age, "city": city}))
        customer, qty, item = rng.choice(NAMES), rng.randint(2, 40), rng.choice(ITEMS)
        cases.append(("order", f"{customer} ordered {qty} {item} yesterday.",
                      {"customer": customer, "quantity": qty, "item": item}))
        event, city, month, day = (rng.choice(EVENTS), rng.choice(CITIES), rng.choice(MONTHS),
                                   rng.randint(1, 28))
        cases.append(("event", f"The {event} takes place in {city} on {month} {day}.",
                      {"event": event, "city": city, "month": month, "day": day}))
    return cases


def messages(kind: str, sentence: str) -> list[dict[str, str]]:
    keys = ", ".join(SCHEMAS[kind]["properties"])
    return [{"role": "system",
             "content": f"Extract the facts of the user's sentence as a JSON object with the "
                        f"keys {keys}. Answer with the JSON object only."},
            {"role": "user", "content": sentence}]


def first_json_object(text: str) -> Any:
    """The first JSON object in text, or None."""
    decoder = json.JSONDecoder()
    for start, char in enumerate(text):
        if char == "{":
            try:
                return decoder.raw_decode(text[start:])[0]
            except ValueError:
                continue
    return None


def score(kind: str, value: Any, truth: dict[str, Any]) -> tuple[bool, int]:
    """(valid, fields equal to the truth) of one answer."""
    try:
        jsonschema.validate(value, SCHEMAS[kind])
    except jsonschema.ValidationError:
        return False, 0
    right = sum(str(value[k]).strip().lower() == str(v).strip().lower()
                for k, v in truth.items())
    return True, right


def run(llm: LLM, cases: list, enforced: bool, max_tokens: int) -> dict[str, Any]:
    """Valid rate and field accuracy per kind and overall, and tokens/s, of one mode."""
    params = [SamplingParams(
        temperature=0.0, max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=SCHEMAS[k]) if enforced else None)
        for k, _, _ in cases]
    start = time.perf_counter()
    outs = llm.chat([messages(k, s) for k, s, _ in cases], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tally: dict[str, list[int]] = {}
    tokens = 0
    for (kind, _, truth), out in zip(cases, outs):
        completion = out.outputs[0]
        tokens += len(completion.token_ids)
        value = (json.loads(completion.text) if enforced and completion.finish_reason == "stop"
                 else first_json_object(completion.text))
        valid, right = score(kind, value, truth)
        for key in (kind, "all"):
            t = tally.setdefault(key, [0, 0, 0, 0])  # sentences, valid, right, fields
            t[0] += 1
            t[1] += valid
            t[2] += right
            t[3] += len(truth)
    return {
        "tok_per_s": tokens / elapsed,
        "kinds": {k: {"valid": t[1] / t[0], "field_accuracy": t[2] / t[3], "n": t[0]}
                  for k, t in tally.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--per-kind", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cases = make_cases(args.per_kind)
    llm = LLM(args.model, max_model_len=args.max_model_len,
              async_scheduling=args.async_scheduling)
    try:
        results = {"free": run(llm, cases, False, args.max_tokens),
                   "enforced": run(llm, cases, True, args.max_tokens)}
    finally:
        llm.shutdown()
    print(f"model {args.model}, {len(cases)} sentences, greedy, max_tokens {args.max_tokens}")
    print(f"{'kind':8} {'mode':9} {'valid':>6} {'fields':>7}")
    for kind in [*SCHEMAS, "all"]:
        for mode in ("free", "enforced"):
            r = results[mode]["kinds"][kind]
            print(f"{kind:8} {mode:9} {r['valid']:6.0%} {r['field_accuracy']:7.0%}")
    for mode in ("free", "enforced"):
        print(f"{mode}: {results[mode]['tok_per_s']:.1f} tok/s")
    gain = (results["enforced"]["kinds"]["all"]["field_accuracy"]
            - results["free"]["kinds"]["all"]["field_accuracy"])
    print(f"field accuracy, enforced - free: {gain:+.0%}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, **results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
