"""Training recipes: every knob of a head-training run, stored as JSON next to the head it produced."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fsd_eagle.errors import InputError


@dataclass
class Recipe:
    """target: local model folder (None = the default SmolLM2-135M-Instruct). data: conversation files
    (jsonl/jsonl.gz from ``python -m training.data prepare``). distill: regenerate the first
    ``distill_turns`` assistant turns of ``distill_count`` conversations with the target (greedy) and train on
    both answers."""

    target: str | None = None
    init: str | None = None  # a head folder to start from (warm start: its weights; a fresh optimizer and schedule)
    data: list[str] = field(default_factory=list)
    distill: bool = True
    answers: str = "both"  # with distill: train on the "both" answers, or only "distilled" / "original" ones
    distill_count: int = 0  # 0 = all conversations
    distill_batch: int = 512
    distill_prompt_tokens: int = 384
    distill_new_tokens: int = 256
    distill_turns: int = 1  # regenerate the first N assistant turns, each after the target's own earlier answers
    max_len: int = 1024
    tokens_per_batch: int = 16384
    epochs: int = 6
    max_steps: int = 0  # 0 = no cap; else training stops (LR schedule fitted) after this many steps
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 200
    grad_clip: float = 0.5
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    noise: float = 0.2
    unroll: int = 1  # training-time test: steps of the head on its own predictions (1 = EAGLE-2's teacher forcing)
    unroll_decay: float = 0.8  # step j's loss weight is unroll_decay ** j (normalised to sum 1)
    val_fraction: float = 0.01
    val_prompts: int = 8
    val_new_tokens: int = 96
    checkpoint_every: int = 500
    seed: int = 0

    @classmethod
    def load(cls, path: str | Path) -> "Recipe":
        path = Path(path)
        if not path.exists():
            raise InputError(f"recipe {path} not found")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"recipe {path} is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise InputError(f"recipe {path} must be a JSON object of settings, not {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known - {"comment"})
        if unknown:
            raise InputError(f"recipe {path} has unknown keys: {', '.join(unknown)}")
        raw.pop("comment", None)
        for f in fields(cls):
            if f.name in raw and not _fits(f.type, raw[f.name]):
                raise InputError(f"recipe {path}: {f.name} must be {_TYPE_NAMES[f.type]}, got {raw[f.name]!r}")
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        recipe = cls(**raw)
        if recipe.distill_turns < 1:
            raise InputError(f"recipe {path}: distill_turns must be at least 1, got {recipe.distill_turns}")
        if recipe.unroll < 1:
            raise InputError(f"recipe {path}: unroll must be at least 1, got {recipe.unroll}")
        if recipe.answers not in ("both", "distilled", "original"):
            raise InputError(f"recipe {path}: answers must be both, distilled or original, not {recipe.answers!r}")
        return recipe

    def to_dict(self) -> dict:
        return asdict(self)


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "str | None": "a string or null", "list[str]": "a list of strings",
               "tuple[float, float]": "a list of two numbers"}


def _fits(type_name: str, value) -> bool:
    """Does a JSON value fit a Recipe field's annotation (written as a string: postponed annotations)?"""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": number,
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "str | None": lambda v: v is None or isinstance(v, str),
        "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "tuple[float, float]": lambda v: isinstance(v, list) and len(v) == 2 and all(number(x) for x in v),
    }[type_name](value)
