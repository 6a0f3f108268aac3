"""``python -m training draft-model --target DIR --layers K --out OUT``: a small draft LM for classic
speculative decoding, built from the target itself: its embeddings, its first K decoder layers, its final
norm and its lm_head, as a stock transformers model of the same architecture with ``num_hidden_layers = K``
(so it shares the target's tokenizer and vocabulary). With ``--data`` it is then distilled briefly from the
target: KL(target || draft) of the next-token distributions at the answer tokens of the conversations
(resumable, like ``finetune``). Writes ``OUT/model``, which ``SpeculativeGenerator.load(target=DIR,
draft_model=OUT/model)`` and ``--draft-model`` take; drafting as a chain of gamma = 5 tokens is the tree
total_tokens 6, depth 5, top_k 1 (presets' ``chain-5``)."""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
from pathlib import Path

import torch

from fsd_eagle.errors import ConfigError, InputError

from .lm_recipe import LMRecipe, find_field_problem
from .lm_train import (add_run_options, check_resumable, export_model, find_eos_ids, read_train_seconds, run_command,
                       split_validation, tokenize_answers, train_lm)

MODEL_DIR = "model"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def truncate_config(config, layers: int):
    """A copy of a causal LM's config with its first ``layers`` decoder layers (per-layer lists such as
    ``layer_types`` cut to match)."""
    total = config.num_hidden_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < total:
        raise ConfigError(f"--layers must be from 1 to {total - 1} (the target has {total} layers), got {layers}")
    small = copy.deepcopy(config)
    small.num_hidden_layers = layers
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:layers]
    if isinstance(getattr(small, "max_window_layers", None), int):
        small.max_window_layers = min(small.max_window_layers, layers)
    return small


def build_draft_model(target: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The target's embeddings, first ``layers`` decoder layers, final norm and lm_head as a new model of
    the target's class (weights copied; tied embeddings stay tied), in eval mode on the target's device."""
    config = target.config
    if config.get_text_config() is not config:
        raise ConfigError("draft-model builds from a text-only causal LM (this target's config nests a text config)")
    small = truncate_config(config, layers)
    device, dtype = next(target.parameters()).device, next(target.parameters()).dtype
    draft = type(target)(small).to(device, dtype)
    state = {k: v for k, v in target.state_dict().items()
             if (m := _LAYER.search(k)) is None or int(m.group(1)) < layers}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if small.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(f"cannot copy the target's weights into a {layers}-layer model: missing "
                          f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft.eval()


def make_kl_loss(target: torch.nn.Module):
    """The distillation loss over answer tokens: KL(p_target || q_draft) of the next-token distributions
    (temperature 1, float32), mean per token; also the share of tokens whose top token both agree on."""

    def loss_fn(draft, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        keep = (mask & attn)[:, 1:]
        with torch.no_grad():
            p_logits = target(input_ids=ids, attention_mask=attn.long()).logits[:, :-1][keep].float()
        q_logits = draft(input_ids=ids, attention_mask=attn.long()).logits[:, :-1][keep].float()
        logp, logq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
        kl = (logp.exp() * (logp - logq)).sum(-1).mean()
        agree = (p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean()
        return kl, {"top1_agree": agree.detach()}

    return loss_fn


def describe_model(target: str, layers: int, total: int, recipe: LMRecipe | None, log: list) -> str:
    """The exported folder's README: what the draft model is and how it was made."""
    made = (f"then distilled with `python -m training draft-model` (training/draft_model.py): KL(target || draft) "
            f"at the answer tokens of {', '.join(recipe.data)}, recipe in `recipe.json`, log in `training.json` "
            f"(last epoch: {json.dumps(log[-1] if log else {})})." if recipe else "not distilled (copied weights only).")
    return (f"# Draft model for classic speculative decoding\n\nThe first {layers} of the {total} decoder layers of "
            f"`{target}`, with its embeddings, final norm and lm_head (a stock transformers model of the same "
            f"architecture, `num_hidden_layers` = {layers}, same tokenizer), {made}\n\nUse: `fsd-eagle generate "
            f"\"...\" --target TARGET --draft-model THIS_FOLDER --total-tokens 6 --depth 5 --tree-top-k 1` "
            "(a chain of gamma = 5 draft tokens per round).\n")


def load_distill_recipe(args: argparse.Namespace) -> LMRecipe | None:
    """The distillation recipe (file, or the defaults) with the command line over it; None without data."""
    recipe = LMRecipe.load(args.recipe) if args.recipe else LMRecipe()
    if args.data:
        recipe.data = list(args.data)
    if args.max_steps is not None:
        problem = find_field_problem("max_steps", args.max_steps)
        if problem:
            raise InputError(f"--max-steps {problem}")
        recipe.max_steps = args.max_steps
    recipe.target = args.target
    recipe.validate(f"recipe {args.recipe}" if args.recipe else "draft-model settings")
    return recipe if recipe.data else None


def run_draft_model(args: argparse.Namespace) -> int:
    from fsd_eagle.cli import quiet_transformers
    from fsd_eagle.models import check_threads, load_target, resolve_device, set_threads

    from .data import read_conversations
    from .finetune import check_out, note, start_out

    recipe = load_distill_recipe(args)
    check_threads(args.threads)
    if args.stop_after is not None and not args.stop_after >= 0:
        raise InputError(f"--stop-after must be seconds >= 0, got {args.stop_after}")
    out = Path(args.out)
    inputs = [*(recipe.data if recipe else []), args.target, getattr(args, "recipe", None)]
    check_out(out, args.resume, args.overwrite, inputs)
    convs = [c for path in recipe.data for c in read_conversations(Path(path))] if recipe else []
    if recipe and not convs:
        raise InputError("the distillation data holds no conversation")
    quiet_transformers()
    device = resolve_device(args.device)
    set_threads(args.threads, device)
    note(f"loading the target ({args.target or 'the default SmolLM2-135M-Instruct'}) on {device}")
    target, tokenizer = load_target(args.target, device, torch.float32)
    total = target.config.num_hidden_layers
    draft = build_draft_model(target, args.layers)
    params = sum(p.numel() for p in draft.parameters())
    note(f"draft model: {args.layers} of {total} layers, {params / 1e6:.1f}M parameters")
    start_out(out, args.overwrite, inputs, "draft model")
    log, what = [], {"target": args.target or "default", "layers": args.layers}
    if recipe:
        for p in target.parameters():
            p.requires_grad_(False)
        eos = find_eos_ids(target, tokenizer)
        train_convs, val_convs = split_validation(convs, recipe.val_fraction)
        examples = [e for e in (tokenize_answers(tokenizer, c.messages, recipe.max_len, eos) for c in train_convs) if e]
        val = [e for e in (tokenize_answers(tokenizer, c.messages, recipe.max_len, eos) for c in val_convs) if e]
        what.update(examples=len(examples), answer_tokens=sum(int(e.mask.sum()) for e in examples))
        if args.resume and not args.overwrite:
            check_resumable(out, recipe, what)
        if not args.resume or args.overwrite:
            shutil.rmtree(out / "checkpoint", ignore_errors=True)
        print(json.dumps({"conversations": len(convs), **what, "parameters": params}), flush=True)
        log, finished = train_lm(draft, examples, val, make_kl_loss(target), recipe, out, args.resume, what,
                                 args.stop_after, note)
        if not finished:
            print(json.dumps({"stopped": True, "checkpoint": str(out / "checkpoint"),
                              "continue": "run the same command with --resume"}))
            return 0
        what["train_s"] = read_train_seconds(out)
    saved = recipe or LMRecipe(target=args.target, save_dtype="float32")  # copied weights: kept exactly
    final = export_model(draft, tokenizer, out, MODEL_DIR, saved, log,
                         describe_model(what["target"], args.layers, total, recipe, log), {**what, "parameters": params})
    print(json.dumps({"model": str(final), **{k: what[k] for k in ("layers", "train_s") if k in what},
                      "final": log[-1] if log else None}))
    return 0


def main(argv: list[str]) -> int:
    from fsd_eagle.cli import OneLineParser

    p = OneLineParser(prog="python -m training draft-model", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="local target folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--layers", type=int, required=True, help="decoder layers to keep (the target's first K)")
    p.add_argument("--out", required=True, help="run folder: checkpoint/ while distilling, model/ at the end")
    p.add_argument("--data", action="append", help="conversation file(s) to distill on (none: no distillation)")
    p.add_argument("--recipe", help="distillation recipe JSON (training/recipes/*draft*.json; default: built-in)")
    add_run_options(p, "distillation")
    args = p.parse_args(argv)
    return run_command(run_draft_model, args, "distillation")
