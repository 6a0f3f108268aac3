"""``python -m training finetune RECIPE --out DIR``: full fine-tuning of a causal-LM target on conversation
files (e.g. GSM8K train and generated arithmetic problems asked as the evaluation asks them:
``python -m training data prepare --gsm8k --arith N --eval-prompts``), cross-entropy on answer tokens only.
Writes ``DIR/model``, a complete transformers model folder that ``SpeculativeGenerator.load(target=...)``
and ``--target`` take, with its recipe and a model card; ``--resume`` continues from ``DIR/checkpoint``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from fsd_eagle.errors import InputError
from fsd_eagle.outputs import check_replaceable, clear_folder, mark_ours

from .lm_recipe import LMRecipe, find_field_problem
from .lm_train import (add_run_options, check_resumable, export_model, find_eos_ids, read_train_seconds, run_command,
                       split_validation, tokenize_answers, train_lm)

MODEL_DIR = "model"


def compute_answer_loss(model, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Mean cross-entropy of the answer tokens (``mask``) given everything before them, and the share of
    them the model predicts as its top token (``acc``)."""
    logits = model(input_ids=ids, attention_mask=attn.long()).logits[:, :-1]
    keep = (mask & attn)[:, 1:]
    chosen, labels = logits[keep].float(), ids[:, 1:][keep]
    loss = F.cross_entropy(chosen, labels)
    return loss, {"acc": (chosen.argmax(-1) == labels).float().mean().detach()}


def note(message: str) -> None:
    """A progress line on stderr (stdout carries the run's JSON lines)."""
    print(message, file=sys.stderr, flush=True)


def load_recipe(args: argparse.Namespace) -> LMRecipe:
    """The recipe file with the command line's values over it, every value checked before any work."""
    recipe = LMRecipe.load(args.recipe)
    if args.target:
        recipe.target = args.target
    if args.data:
        recipe.data = list(args.data)
    for key in ("epochs", "max_steps"):
        value = getattr(args, key)
        if value is not None:
            problem = find_field_problem(key, value)
            if problem:
                raise InputError(f"--{key.replace('_', '-')} {problem}")
            setattr(recipe, key, value)
    recipe.validate(f"recipe {args.recipe}")
    if not recipe.data:
        raise InputError("no training data: give --data FILE (from 'python -m training data prepare') or set it "
                         "in the recipe")
    return recipe


LEGACY_FILES = ("training.json", "checkpoint/progress.json")  # only our runs write these (before MARK existed)


def check_out(out: Path, resume: bool, overwrite: bool, inputs: Sequence = ()) -> None:
    """Fail before any work if ``out`` cannot take this run; with ``overwrite`` it must be a run folder of
    ours holding none of ``inputs`` (it is emptied later, by ``start_out``)."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not (resume or overwrite):
        raise InputError(f"{out} already holds a run: pass --resume to continue it or --overwrite")
    if overwrite:
        check_replaceable(out, inputs, "--overwrite", legacy=LEGACY_FILES)


def start_out(out: Path, overwrite: bool, inputs: Sequence, kind: str) -> None:
    """Make the run folder ``out`` (emptied first with ``overwrite``, see ``check_out``) and mark it ours."""
    if overwrite:
        clear_folder(out, inputs, "--overwrite", legacy=LEGACY_FILES)
    out.mkdir(parents=True, exist_ok=True)
    mark_ours(out, kind)


def describe_model(recipe: LMRecipe, target: str, examples: int, tokens: int, log: list) -> str:
    """The exported folder's README: what it is, how it was made and how to rerun it."""
    last = log[-1] if log else {}
    return (f"# Fine-tuned target\n\nFull fine-tune (every weight; no adapters) of `{target}` with "
            f"`python -m training finetune` (training/finetune.py): cross-entropy on the answer tokens of "
            f"{examples} conversations ({tokens} answer tokens per epoch) from {', '.join(recipe.data)}, "
            f"{recipe.epochs} epoch(s), AdamW (lr {recipe.lr:g}, cosine to {recipe.min_lr_ratio:g} x), "
            f"{recipe.tokens_per_batch} padded tokens per step. The recipe is in `recipe.json`, the per-epoch "
            f"log in `training.json` (last epoch: {json.dumps(last)}).\n\n"
            "Accuracy is measured by the evaluation, not here: `python -m eval sweep --target THIS_FOLDER "
            "--methods ar --tasks gsm8k arith --batch-size 64 --out DIR`.\n")


def run_finetune(args: argparse.Namespace) -> int:
    from fsd_eagle.cli import quiet_transformers
    from fsd_eagle.models import check_threads, load_target, resolve_device, set_threads

    from .data import read_conversations

    recipe = load_recipe(args)
    check_threads(args.threads)
    out = Path(args.out)
    inputs = [*recipe.data, recipe.target, getattr(args, "recipe", None)]
    check_out(out, args.resume, args.overwrite, inputs)
    if args.stop_after is not None and not args.stop_after >= 0:
        raise InputError(f"--stop-after must be seconds >= 0, got {args.stop_after}")
    convs = [c for path in recipe.data for c in read_conversations(Path(path))]
    if not convs:
        raise InputError("the training data holds no conversation")
    quiet_transformers()
    device = resolve_device(args.device)
    set_threads(args.threads, device)
    note(f"loading the target ({recipe.target or 'the default SmolLM2-135M-Instruct'}) on {device}")
    model, tokenizer = load_target(recipe.target, device, torch.float32)  # fp32 master weights
    eos = find_eos_ids(model, tokenizer)
    train_convs, val_convs = split_validation(convs, recipe.val_fraction)
    note(f"tokenizing {len(convs)} conversations (chat template, answer-token masks)")
    examples = [e for e in (tokenize_answers(tokenizer, c.messages, recipe.max_len, eos) for c in train_convs) if e]
    val = [e for e in (tokenize_answers(tokenizer, c.messages, recipe.max_len, eos) for c in val_convs) if e]
    tokens = sum(int(e.mask.sum()) for e in examples)
    what = {"target": recipe.target or "default", "examples": len(examples), "answer_tokens": tokens}
    if args.resume and not args.overwrite:
        check_resumable(out, recipe, what)
    start_out(out, args.overwrite, inputs, "fine-tune")
    print(json.dumps({"conversations": len(convs), "examples": len(examples), "val_examples": len(val),
                      "answer_tokens": tokens}), flush=True)
    log, finished = train_lm(model, examples, val, compute_answer_loss, recipe, out, args.resume, what, args.stop_after,
                             note)
    if not finished:
        print(json.dumps({"stopped": True, "checkpoint": str(out / "checkpoint"),
                          "continue": "run the same command with --resume"}))
        return 0
    extra = {**what, "train_s": read_train_seconds(out),
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    final = export_model(model, tokenizer, out, MODEL_DIR, recipe, log,
                         describe_model(recipe, what["target"], len(examples), tokens, log), extra)
    print(json.dumps({"model": str(final), "train_s": extra["train_s"], "final": log[-1] if log else None}))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe JSON (training/recipes/*finetune*.json)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/ while training, model/ at the end")
    p.add_argument("--target", help="local target folder (overrides the recipe; default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", action="append", help="conversation file(s) (override the recipe)")
    p.add_argument("--epochs", type=int)
    add_run_options(p, "training")


def main(argv: list[str]) -> int:
    from fsd_eagle.cli import OneLineParser

    p = OneLineParser(prog="python -m training finetune", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return run_command(run_finetune, args, "training")
