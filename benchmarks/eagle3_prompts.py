"""Prompts for training an EAGLE-3 head by self-distillation (benchmarks/train_eagle3.py).

A head only learns the states its training text visits: trained on a few dozen templated chat
prompts it fits those conversations and guesses poorly elsewhere (held-out top-1 agreement
well under its training figure, worst on plain completions, which it never saw). So the
prompts here are many and varied, built from parts: chat requests of several kinds (stories,
explanations, lists, advice, letters, JSON extraction, code) over many subjects, and plain
text openings sent without the chat template (what /v1/completions and `LLM.generate` send).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SUBJECTS = [
    "the ocean", "a small village", "quantum computers", "green tea", "a robot", "jazz",
    "honey bees", "the moon", "bread", "trains", "volcanoes", "chess", "the Roman empire",
    "photosynthesis", "a lighthouse keeper", "electric cars", "the stock market", "dinosaurs",
    "coffee", "the internet", "a haunted house", "mountain climbing", "recycling", "penguins",
    "black holes", "a dragon", "the French revolution", "machine learning", "gardening",
    "the human heart", "a detective", "rain forests", "football", "origami", "the printing press",
    "a space station", "cats", "climate change", "a pirate ship", "the piano", "vaccines",
    "a desert island", "cheese", "earthquakes", "a time traveller", "solar panels", "wolves",
    "the Olympic games", "a bakery", "ancient Egypt", "friendship", "a lost key", "the brain",
    "video games", "a thunderstorm", "a wizard", "bicycles", "the Great Wall", "snow",
    "a job interview", "owls", "the immune system", "a submarine", "democracy", "mushrooms",
]
NAMES = ["Ada", "Ben", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas",
         "Kenji", "Lena", "Marco", "Nadia", "Omar", "Priya", "Quentin", "Rosa", "Sam", "Tara"]
PLACES = ["Paris", "Lagos", "Lima", "Oslo", "Seoul", "Cairo", "Denver", "Hanoi", "Porto",
          "Quebec", "Nairobi", "Zurich", "Austin", "Kyoto", "Dublin"]
CHAT = [
    "Write a short story about {s}.", "Explain {s} to a child.", "List three facts about {s}.",
    "Write a poem about {s}.", "What are the pros and cons of {s}?",
    "Summarise the history of {s} in a paragraph.", "Give me five tips related to {s}.",
    "Write a product description for something inspired by {s}.",
    "Compare {s} and {t} in a few sentences.", "Why do people care about {s}?",
    "Write an email to {n} about {s}.", "Tell me a joke about {s}.",
    "Describe a day in the life of someone who loves {s}.",
    "What questions should I ask an expert on {s}?", "Write a haiku about {s}.",
    "Plan a one-day trip to {p} for someone interested in {s}.",
    "Write a dialogue between {n} and {m} about {s}.", "How does {s} work?",
    "Give me a JSON object describing {s} with the fields name, summary and tags.",
    "Return a JSON list of three facts about {s}, each with a fact and a source field.",
    "Extract the people and places as JSON: {n} met {m} in {p} to talk about {s}.",
    "Turn this into JSON with keys name, age and city: {n} is {a} years old and lives in {p}.",
    "Answer in JSON with keys answer and confidence: is {s} older than {t}?",
]
CODE = [
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "Explain how to write code that {c}.", "Write a unit test for a function that {c}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a text",
    "merges two sorted lists", "parses a date from a string", "computes a factorial",
    "finds the largest value in a list", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "reads a CSV file and sums a column",
    "validates an email address", "flattens a nested list", "returns the n-th Fibonacci number",
    "groups words by their first letter", "sorts a list of dictionaries by a key",
]
OPENINGS = [
    "Once upon a time, {s}", "The story of {s} begins", "{S} is",
    "Here is a short story about {s}:\n\n", "Q: What do you know about {s}?\nA:",
    "Notes on {s}:\n1.",
    "Chapter 1\n\n{N} had never thought much about {s}", "Dear {n},\n\nI am writing about {s}",
    "Task {i}: write about {s}", "Title: {S}\n\n", "The best thing about {s} is",
    "In {p}, everyone talks about {s}", "def {f}(", '{{"name": "{n}", "topic": "{s}", "',
    "A short guide to {s}\n\n", "Interview with {n} about {s}\n\nQ:", "Why {s} matters:",
    "{N} and {M} were arguing about {s} when",
]


@dataclass
class Prompt:
    """One training prompt: chat messages (sent with the chat template) or plain text."""

    chat: list[dict[str, str]] | None = None
    text: str | None = None


def _fill(template: str, rng: random.Random, i: int) -> str:
    """The template with its slots filled at random (subjects, names, places, code tasks)."""
    s, t = rng.sample(SUBJECTS, 2)
    n, m = rng.sample(NAMES, 2)
    task = rng.choice(CODE_TASKS)
    return template.format(s=s, t=t, S=s[0].upper() + s[1:], n=n, m=m, N=n, M=m,
                           p=rng.choice(PLACES), a=rng.randint(18, 90), i=i, c=task,
                           f=task.split()[0] + "_" + task.split()[-1])


def make_prompts(n: int, seed: int, plain_share: float = 0.35,
                 code_share: float = 0.15) -> list[Prompt]:
    """n prompts: about `plain_share` plain-text openings, `code_share` coding requests, the
    rest chat requests (module docstring), in random order, reproducible from `seed`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.random()
        if kind < plain_share:
            out.append(Prompt(text=_fill(rng.choice(OPENINGS), rng, i)))
        else:
            pool = CODE if kind < plain_share + code_share else CHAT
            out.append(Prompt(chat=[{"role": "user", "content": _fill(rng.choice(pool), rng, i)}]))
    return out
