"""What a training run is made of (its target, recipe values and data), stored in the run folder when the run
starts, so that ``--resume`` continues only the same run: resuming with another target would train and
export a head for another model over the run's good one."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from fsd_eagle.errors import InputError
from fsd_eagle.jsonl import write_text_atomic

from .recipe import Recipe

FINGERPRINT_FILE = "run.json"
# What a new run folder may be seeded with before its first run (self-distilled answers from another run
# folder, with the settings they were made with, which the distillation stage checks itself).
SEED_FILES = frozenset({"distilled.jsonl.gz", "distilled.json"})

# Recipe values a resumed call may change: how long to train (a resume may extend a run), how often to save,
# how validation is measured, which attention kernels compute the same attention, whether the same loss is
# compiled, the data files' paths
# (their contents are compared, under "data"), and the distillation settings (checked against the cached
# answers by check_distilled, which lets a resume extend them to more turns).
RESUMABLE = frozenset({"epochs", "max_steps", "checkpoint_every", "val_prompts", "val_new_tokens", "distill_count",
                       "distill_batch", "distill_prompt_tokens", "distill_new_tokens", "distill_turns", "target",
                       "data", "extra_distilled", "cudnn_attention", "compile", "distill_cache"})


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SAMPLE = 4 << 20  # bytes read from each end of a weight file


def target_fingerprint(folder: Path) -> dict:
    """The target by content, cheaply: its config.json's sha256, and for each weight file its name, size and
    a sha256 of its first and last 4 MiB (other weights of the same shapes differ there; a folder moved
    elsewhere is the same target)."""
    weights = {}
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin") and p.is_file()):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(SAMPLE))
            size = f.seek(0, 2)
            f.seek(max(0, size - SAMPLE))
            digest.update(f.read(SAMPLE))
        weights[path.name] = {"size": size, "sampled_sha256": digest.hexdigest()}
    return {"path": str(folder), "config_sha256": file_sha256(folder / "config.json"), "weights": weights}


def run_fingerprint(recipe: Recipe, target_dir: Path) -> dict:
    data = [{"path": str(p), "sha256": file_sha256(Path(p))} for p in [*recipe.data, *recipe.extra_distilled]]
    values = {k: v for k, v in recipe.to_dict().items() if k not in RESUMABLE}
    return {"target": target_fingerprint(target_dir), "recipe": json.loads(json.dumps(values)), "data": data}


def write_fingerprint(out: Path, fingerprint: dict) -> None:
    write_text_atomic(out / FINGERPRINT_FILE, json.dumps(fingerprint, indent=2) + "\n")


def check_resume(out: Path, fingerprint: dict) -> None:
    """Refuse to resume a run folder made for another target, recipe or data, naming the difference. A folder
    without a fingerprint (a run started before runs had one) is taken as is, with a note; one that holds
    nothing but seeded distilled answers is a new run, without one."""
    path = out / FINGERPRINT_FILE
    if not path.exists():
        if out.is_dir() and any(p.name not in SEED_FILES for p in out.iterdir()):
            print(f"note: {out} has no {FINGERPRINT_FILE} (a run started by an older version): not checked",
                  file=sys.stderr, flush=True)
        return
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read {path} ({e}): use another --out or --overwrite") from None
    difference = describe_difference(stored, fingerprint)
    if difference:
        raise InputError(f"--resume: {out} is a run for {difference}; use another --out, or --overwrite to start over")


def describe_difference(old: dict, new: dict) -> str | None:
    """The first way the stored run differs from this call, as words ("another target (...)"), or None."""
    a, b = old.get("target", {}), new["target"]
    if (a.get("config_sha256"), a.get("weights")) != (b["config_sha256"], b["weights"]):
        return f"another target ({a.get('path')}, not {b['path']})"
    # a value a run's stored recipe lacks (a field added since it started) is that field's default
    defaults = json.loads(json.dumps(Recipe().to_dict()))
    recipe_a, recipe_b = {**defaults, **old.get("recipe", {})}, new["recipe"]
    changed = sorted(k for k in set(recipe_a) & set(recipe_b) if recipe_a[k] != recipe_b[k])
    if changed:
        shown = ", ".join(f"{k} {recipe_a.get(k)!r}, not {recipe_b.get(k)!r}" for k in changed[:3])
        return f"other recipe values ({shown})"
    data_a, data_b = old.get("data", []), new["data"]
    if [d.get("sha256") for d in data_a] != [d["sha256"] for d in data_b]:
        was = ", ".join(Path(d.get("path", "?")).name for d in data_a)
        now = ", ".join(Path(d["path"]).name for d in data_b)
        return f"other data ({was} as it was then, not {now} as it is now)"
    return None
