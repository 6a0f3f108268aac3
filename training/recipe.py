"""Training recipes: every knob of a head-training run, stored as JSON next to the head it produced."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from fsd_eagle.errors import InputError


@dataclass
class Recipe:
    """target: local model folder (None = the default SmolLM2-135M-Instruct). data: conversation files
    (jsonl/jsonl.gz from ``python -m training.data prepare``). distill: regenerate the first assistant turn
    of ``distill_count`` conversations with the target (greedy) and train on both answers."""

    target: str | None = None
    data: list[str] = field(default_factory=list)
    distill: bool = True
    distill_count: int = 0  # 0 = all conversations
    distill_batch: int = 512
    distill_prompt_tokens: int = 384
    distill_new_tokens: int = 256
    max_len: int = 1024
    tokens_per_batch: int = 16384
    epochs: int = 6
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 200
    grad_clip: float = 0.5
    feature_weight: float = 1.0
    ce_weight: float = 0.1
    noise: float = 0.2
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
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        return cls(**raw)

    def to_dict(self) -> dict:
        return asdict(self)
