"""Training recipes: every knob of a head-training run, stored as JSON next to the head it produced."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fsd_eagle.errors import InputError


@dataclass
class Recipe:
    """target: local model folder (None = the default SmolLM2-135M-Instruct). data: conversation files
    (jsonl/jsonl.gz from ``python -m training.data prepare``). distill: regenerate the first
    ``distill_turns`` assistant turns of ``distill_count`` conversations with the target (greedy, or
    ``distill_samples`` answers sampled at ``distill_temperature``) and train on both answers.
    extra_distilled: the target's answers made by earlier runs (their ``distilled.jsonl.gz``), trained on as
    distilled answers beside this run's own, e.g. greedy answers beside sampled ones."""

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
    distill_temperature: float = 0.0  # 0 = the target's greedy answers; above 0 = sampled at this temperature
    distill_samples: int = 1  # answers per conversation (more than 1 needs distill_temperature > 0)
    distill_cache: str = "dynamic"  # generate's KV cache in self-distillation: "dynamic" or "static" (distill._answer)
    extra_distilled: list[str] = field(default_factory=list)  # earlier runs' distilled.jsonl.gz, trained on too
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
    arch: str = "eagle2"  # the head: "eagle2" (EAGLE-1/2) or "eagle3" (fused target layers, own draft lm_head)
    layers: list[int] = field(default_factory=list)  # eagle3: target layers read ([] = HeadConfig's default)
    draft_vocab_size: int = 0  # eagle3: the head's lm_head covers the N most frequent answer tokens (0 = all)
    head_intermediate_size: int = 0  # the head's MLP width (0 = the target's intermediate_size, EAGLE's choice)
    cudnn_attention: bool = False  # true: training's SDPA may use cuDNN's kernel (train.attention_kernels)
    compile: bool = False  # true: the target's forward and the loss's logits are compiled (train.loss_parts)
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
            raw = json.loads(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise InputError(f"recipe {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise InputError(f"recipe {path} is not valid JSON ({e})") from None
        except OSError as e:
            raise InputError(f"cannot read recipe {path}: {e.strerror or e}") from None
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
        recipe.validate(f"recipe {path}")
        return recipe

    def validate(self, where: str = "recipe") -> None:
        """Refuse values a run cannot use (before any data is read or distilled), with one line that names
        ``where`` they come from: e.g. negative epochs, a zero checkpoint interval, a NaN learning rate."""
        for f in fields(self):
            problem = field_problem(f.name, getattr(self, f.name))
            if problem:
                raise InputError(f"{where}: {f.name} {problem}")
        if self.arch == "eagle2" and (self.layers or self.draft_vocab_size):
            raise InputError(f"{where}: layers and draft_vocab_size are eagle3 settings (arch is eagle2)")
        if self.distill_samples > 1 and self.distill_temperature == 0:
            raise InputError(f"{where}: distill_samples {self.distill_samples} needs distill_temperature > 0 "
                             "(greedy answers would all be the same)")
        if self.extra_distilled and self.answers == "original":
            raise InputError(f"{where}: extra_distilled holds distilled answers, which answers \"original\" leaves out")
        if self.arch == "eagle2" and self.feature_weight == 0 and self.ce_weight == 0:
            raise InputError(f"{where}: feature_weight and ce_weight are both 0 (nothing to learn)")

    def to_dict(self) -> dict:
        return asdict(self)


MAX_INT = 2**31 - 1  # no count or size of a run comes near it; larger values are typos or overflow
# name -> (least, most) for integers; seeds also feed torch.manual_seed (at most 2**63 - 1)
INT_RANGES = {"distill_count": (0, MAX_INT), "distill_batch": (1, MAX_INT), "distill_prompt_tokens": (1, MAX_INT),
              "distill_new_tokens": (1, MAX_INT), "distill_turns": (1, MAX_INT), "distill_samples": (1, 64),
              "max_len": (2, MAX_INT), "tokens_per_batch": (1, MAX_INT), "epochs": (1, MAX_INT), "max_steps": (0, MAX_INT),
              "warmup_steps": (0, MAX_INT), "unroll": (1, 64), "val_prompts": (0, MAX_INT),
              "val_new_tokens": (1, MAX_INT), "checkpoint_every": (1, MAX_INT), "seed": (0, 2**63 - 1),
              "draft_vocab_size": (0, MAX_INT), "head_intermediate_size": (0, MAX_INT)}
# name -> (least, whether the least is allowed, most or None) for numbers; every one must be finite
FLOAT_RANGES = {"distill_temperature": (0.0, True, None), "lr": (0.0, True, None), "weight_decay": (0.0, True, None),
                "grad_clip": (0.0, False, None), "feature_weight": (0.0, True, None), "ce_weight": (0.0, True, None), "noise": (0.0, True, None),
                "unroll_decay": (0.0, True, None), "val_fraction": (0.0, True, 1.0)}
ANSWERS = ("both", "distilled", "original")
ARCHS = ("eagle2", "eagle3")
DISTILL_CACHES = ("dynamic", "static")


def field_problem(name: str, value) -> str | None:
    """What is wrong with a recipe value ("must be at least 1, got 0"), or None when it is usable."""
    if name in INT_RANGES:
        least, most = INT_RANGES[name]
        if not isinstance(value, int) or isinstance(value, bool):
            return f"must be an integer, got {value!r}"
        if value < least:
            return f"must be at least {least}, got {value}"
        if value > most:
            return f"must be at most {most}, got {value}"
    elif name in FLOAT_RANGES:
        least, inclusive, most = FLOAT_RANGES[name]
        if not _is_number(value) or not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if value < least or (value == least and not inclusive):
            return f"must be {'at least' if inclusive else 'more than'} {least:g}, got {value!r}"
        if most is not None and value >= most:
            return f"must be less than {most:g}, got {value!r}"
    elif name == "betas":
        if (not isinstance(value, (tuple, list)) or len(value) != 2
                or not all(_is_number(b) and math.isfinite(b) and 0 <= b < 1 for b in value)):
            return f"must be two numbers in [0, 1), got {value!r}"
    elif name == "answers" and value not in ANSWERS:
        return f"must be both, distilled or original, not {value!r}"
    elif name == "distill_cache" and value not in DISTILL_CACHES:
        return f"must be dynamic or static, not {value!r}"
    elif name == "arch" and value not in ARCHS:
        return f"must be eagle2 or eagle3, not {value!r}"
    elif name == "layers" and not (isinstance(value, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_INT for i in value)):
        return f"must be a list of target layer ids >= 0, got {value!r}"
    elif name in ("distill", "cudnn_attention", "compile") and not isinstance(value, bool):
        return f"must be true or false, got {value!r}"
    elif name in ("target", "init") and value is not None and not isinstance(value, str):
        return f"must be a string or null, got {value!r}"
    elif name in ("data", "extra_distilled") and not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        return f"must be a list of strings, got {value!r}"
    return None


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_TYPE_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
               "str | None": "a string or null", "list[str]": "a list of strings", "list[int]": "a list of integers",
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
        "list[int]": lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
        "tuple[float, float]": lambda v: isinstance(v, list) and len(v) == 2 and all(number(x) for x in v),
    }[type_name](value)
