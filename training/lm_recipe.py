"""Recipes of the causal-LM trainers (``python -m training finetune`` and ``draft-model``): every knob of a
run, stored as JSON next to the model it produced. Full fine-tuning only (every weight trains; no adapters)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fsd_eagle.errors import InputError

from .recipe import MAX_INT


@dataclass
class LMRecipe:
    """target: local model folder (None = the default SmolLM2-135M-Instruct). data: conversation files
    (from ``python -m training data prepare``). The loss counts answer tokens only (each assistant turn after
    the chat template's generation prompt, up to its end-of-turn token): cross-entropy on the data's answers
    for ``finetune``, KL(target || draft) for ``draft-model``. AdamW, linear warm-up, cosine decay to
    ``min_lr_ratio`` x ``lr``; bf16 autocast on a GPU (fp32 master weights)."""

    target: str | None = None
    data: list[str] = field(default_factory=list)
    max_len: int = 768  # tokens per conversation (longer ones are cut)
    tokens_per_batch: int = 32768  # padded tokens per step (length-bucketed batches)
    epochs: int = 3
    max_steps: int = 0  # 0 = no cap; else the run (and its LR schedule) ends after this many steps
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.01
    warmup_steps: int = 50
    grad_clip: float = 1.0  # max global gradient norm
    val_fraction: float = 0.01  # conversations held out for the validation loss after each epoch
    checkpoint_every: int = 200
    save_dtype: str = "bfloat16"  # the exported model's weights: bfloat16 or float32
    seed: int = 0

    @classmethod
    def load(cls, path: str | Path) -> "LMRecipe":
        """A recipe file (JSON object; a "comment" key is allowed), every value checked."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(f"recipe {path} not found") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InputError(f"recipe {path} is not valid JSON ({e})") from None
        except OSError as e:
            raise InputError(f"cannot read recipe {path}: {e.strerror or e}") from None
        if not isinstance(raw, dict):
            raise InputError(f"recipe {path} must be a JSON object of settings, not {type(raw).__name__}")
        raw.pop("comment", None)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise InputError(f"recipe {path} has unknown keys: {', '.join(unknown)}")
        if isinstance(raw.get("betas"), list):
            raw["betas"] = tuple(raw["betas"])
        recipe = cls(**raw)
        recipe.validate(f"recipe {path}")
        return recipe

    def validate(self, where: str = "recipe") -> None:
        """Refuse a value a run cannot use, with one line naming ``where`` it comes from."""
        for f in fields(self):
            problem = find_field_problem(f.name, getattr(self, f.name))
            if problem:
                raise InputError(f"{where}: {f.name} {problem}")

    def to_dict(self) -> dict:
        return asdict(self)


INTS = {"max_len": (2, MAX_INT), "tokens_per_batch": (1, MAX_INT), "epochs": (1, MAX_INT),
        "max_steps": (0, MAX_INT), "warmup_steps": (0, MAX_INT), "checkpoint_every": (1, MAX_INT),
        "seed": (0, 2**63 - 1)}
# name -> (least, least allowed, most or None)
FLOATS = {"lr": (0.0, False, None), "min_lr_ratio": (0.0, True, 1.0), "weight_decay": (0.0, True, None),
          "grad_clip": (0.0, False, None), "val_fraction": (0.0, True, 0.5)}


def find_field_problem(name: str, value) -> str | None:
    """What is wrong with a recipe value ("must be at least 1, got 0"), or None when it is usable."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_num = isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in INTS:
        least, most = INTS[name]
        if not is_int:
            return f"must be an integer, got {value!r}"
        if not least <= value <= most:
            return f"must be from {least} to {most}, got {value}"
    elif name in FLOATS:
        least, inclusive, most = FLOATS[name]
        if not is_num or not math.isfinite(value):
            return f"must be a finite number, got {value!r}"
        if value < least or (value == least and not inclusive) or (most is not None and value > most):
            return f"must be {'>=' if inclusive else '>'} {least:g}" + (f" and <= {most:g}" if most else "") + \
                f", got {value!r}"
    elif name == "betas":
        if not (isinstance(value, tuple) and len(value) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)):
            return f"must be two numbers in [0, 1), got {value!r}"
    elif name == "target" and value is not None and not isinstance(value, str):
        return f"must be a string or null, got {value!r}"
    elif name == "data" and not (isinstance(value, list) and all(isinstance(x, str) for x in value)):
        return f"must be a list of file names, got {value!r}"
    elif name == "save_dtype" and value not in ("bfloat16", "float32"):
        return f"must be bfloat16 or float32, got {value!r}"
    return None
