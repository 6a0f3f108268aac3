"""Multi-step integer arithmetic word problems, generated: a task whose answers can be checked exactly and on
which a small target, fine-tuned on the train split, scores well above its floor (GSM8K is too hard for a
135M model to move much). The ``test`` split is held out: no train problem has a test problem's text.

Problem i of a split is drawn from its own generator, seeded with the text ``"arith-<split>-<i>"`` (string
seeding is stable across Python versions) and read through ``random()`` only (the one draw Python keeps
stable), so a split's problems never change and a larger count keeps the problems of a smaller one.

A problem: someone starts with A items, then 2 to 5 steps (buy more, give some away, packs of B items each,
a number that doubles or triples, an equal share among K people), then "How many ... now?". The solution
writes one line per step with the operation and its result, then "The answer is N." (the format the GSM8K
prompt asks for, so one scorer serves both tasks)."""

from __future__ import annotations

import random
from dataclasses import dataclass

TEST_SIZE = 1000  # problems in the held-out test split
MAX_VALUE = 2000  # a number doubles (or more) only while the result stays at most this

_NAMES = (("Ava", "she", "her"), ("Ben", "he", "his"), ("Chloe", "she", "her"), ("Diego", "he", "his"),
          ("Emma", "she", "her"), ("Farid", "he", "his"), ("Grace", "she", "her"), ("Hiro", "he", "his"),
          ("Isla", "she", "her"), ("Jamal", "he", "his"), ("Kira", "she", "her"), ("Leo", "he", "his"),
          ("Maya", "she", "her"), ("Noah", "he", "his"), ("Olivia", "she", "her"), ("Priya", "she", "her"))
_ITEMS = ("marbles", "stickers", "apples", "coins", "books", "pencils", "cards", "stamps", "shells", "beads",
          "cookies", "balloons", "crayons", "buttons", "seeds", "tickets")
_FRIENDS = ("a friend", "a neighbor", "a classmate", "a cousin", "the teacher", "a brother", "a sister")


@dataclass
class ArithProblem:
    """One generated problem: its text, a worked solution ending "The answer is N." and N as text."""

    index: int
    question: str
    solution: str
    reference: str


def _int(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] from ``rng.random()`` alone (stable across Python versions)."""
    return lo + min(hi - lo, int(rng.random() * (hi - lo + 1)))


def _pick(rng: random.Random, items: tuple):
    return items[_int(rng, 0, len(items) - 1)]


def _divisors(value: int) -> list[int]:
    return [k for k in range(2, 10) if value % k == 0 and value // k >= 2]


def _step(rng: random.Random, value: int, who: tuple, item: str) -> tuple[str, str, int]:
    """One step on ``value``: (sentence of the problem, line of the solution, new value)."""
    name, pronoun, possessive = who
    kinds = ["add", "packs"]
    if value > 3:
        kinds.append("give")
    if value * 2 <= MAX_VALUE:
        kinds.append("times")
    if _divisors(value):
        kinds.append("share")
    kind = _pick(rng, tuple(kinds))
    if kind == "add":
        b = _int(rng, 2, 99)
        new = value + b
        return (f"{pronoun.capitalize()} finds {b} more {item}.",
                f"After finding {b} more, {name} has {value} + {b} = {new} {item}.", new)
    if kind == "packs":
        k, b = _int(rng, 2, 9), _int(rng, 2, 25)
        new = value + k * b
        return (f"{pronoun.capitalize()} buys {k} packs with {b} {item} in each pack.",
                f"{k} packs of {b} {item} hold {k} * {b} = {k * b} {item}, so {name} has {value} + {k * b} = "
                f"{new} {item}.", new)
    if kind == "give":
        b = _int(rng, 2, value - 1)
        new = value - b
        return (f"{pronoun.capitalize()} gives {b} {item} to {_pick(rng, _FRIENDS)}.",
                f"After giving away {b}, {name} has {value} - {b} = {new} {item}.", new)
    if kind == "times":
        options = tuple(k for k in (2, 3, 4, 5) if value * k <= MAX_VALUE)
        k = _pick(rng, options)
        word = {2: "doubles", 3: "triples", 4: "becomes 4 times as large", 5: "becomes 5 times as large"}[k]
        new = value * k
        return (f"Then the number of {possessive} {item} {word}.",
                f"The number {word}: {value} * {k} = {new} {item}.", new)
    k = _pick(rng, tuple(_divisors(value)))
    new = value // k
    return (f"{pronoun.capitalize()} splits all {possessive} {item} equally among {k} boxes and keeps only one box.",
            f"One of {k} equal boxes holds {value} / {k} = {new} {item}, so {name} has {new} {item}.", new)


def make_problem(split: str, index: int) -> ArithProblem:
    """Problem ``index`` of ``split`` ("train" or "test"), the same on every machine and Python version."""
    rng = random.Random(f"arith-{split}-{index}")
    who, item = _pick(rng, _NAMES), _pick(rng, _ITEMS)
    value = _int(rng, 5, 99)
    sentences = [f"{who[0]} has {value} {item}."]
    lines = [f"{who[0]} starts with {value} {item}."]
    for _ in range(_int(rng, 2, 5)):
        sentence, line, value = _step(rng, value, who, item)
        sentences.append(sentence)
        lines.append(line)
    sentences.append(f"How many {item} does {who[0]} have now?")
    lines.append(f"The answer is {value}.")
    return ArithProblem(index, " ".join(sentences), "\n".join(lines), str(value))


def arith_problems(split: str, count: int | None = None) -> list[ArithProblem]:
    """The first ``count`` problems of a split (test: at most TEST_SIZE, default all; train: ``count``
    required). Train problems whose text is a test problem's are skipped (indices keep counting), so the
    splits never share a question."""
    if split == "test":
        return [make_problem("test", i) for i in range(min(TEST_SIZE, TEST_SIZE if count is None else count))]
    if split != "train":
        raise ValueError(f"arith split must be 'train' or 'test', got {split!r}")
    if count is None:
        raise ValueError("the arith train split is unbounded: give a count")
    held_out = {p.question for p in arith_problems("test")}
    out, i = [], 0
    while len(out) < count:
        p = make_problem("train", i)
        if p.question not in held_out:
            out.append(ArithProblem(len(out), p.question, p.solution, p.reference))
        i += 1
    return out
