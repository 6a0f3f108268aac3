"""The causal-LM training loop shared by ``finetune`` (a target on answers) and ``draft-model`` (a small
draft LM distilled from its target): answer-token examples, length-bucketed batches, AdamW with warm-up and
cosine decay, bf16 autocast on a GPU, resumable checkpoints written atomically, and the export of a complete
transformers model folder."""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fsd_eagle.errors import InputError

from .features import Example, collate, make_batches, make_example, template_ids
from .lm_recipe import LMRecipe

LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict]]


def tokenize_answers(tokenizer, messages: list[dict], max_len: int, eos_ids: frozenset) -> Example | None:
    """Token ids of a conversation under the chat template and a mask of its answer tokens: for each
    assistant turn, the tokens after the generation prompt (exactly the ids a generator is given for the
    conversation so far) up to and including the turn's first end-of-sequence token; what follows it (e.g.
    a newline) is not trained, since generation stops there. A template whose text with the generation
    prompt is no prefix of the answered conversation marks the whole turn. None when nothing is marked."""
    ids: list[int] = []
    mask: list[bool] = []
    for i, msg in enumerate(messages):
        full = template_ids(tokenizer, messages[: i + 1])
        if msg["role"] == "assistant":
            prompt = template_ids(tokenizer, messages[:i], generation_prompt=True)
            start = len(prompt) if full[: len(prompt)] == prompt else len(ids)
            answer = full[start:]
            end = next((k + 1 for k, t in enumerate(answer) if t in eos_ids), len(answer))
            mask = (mask + [False] * len(full))[: start] + [True] * end + [False] * (len(answer) - end)
        else:
            mask = (mask + [False] * len(full))[: len(full)]
        ids = full
        if len(ids) >= max_len:
            break
    return make_example(ids, mask, max_len)


def find_eos_ids(model, tokenizer) -> frozenset:
    """The token ids that end an answer: the generation config's and the tokenizer's end-of-sequence ids."""
    found = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        found.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
    return frozenset(int(t) for t in found)


def split_validation(convs: list, fraction: float) -> tuple[list, list]:
    """(train, validation) conversations: a conversation is held out by a hash of its id (stable)."""
    import hashlib

    def held(conv) -> bool:
        return int(hashlib.sha1(conv.id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction

    return [c for c in convs if not held(c)], [c for c in convs if held(c)]


def lr_at(step: int, total: int, recipe: LMRecipe) -> float:
    """Linear warm-up, then cosine decay from ``lr`` to ``min_lr_ratio`` x ``lr`` at step ``total``."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    frac = min(1.0, (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps))
    low = recipe.min_lr_ratio
    return recipe.lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * frac)))


# ---------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, progress: dict) -> None:
    """Weights, optimizer state and RNG state as safetensors plus progress JSON in ``out/checkpoint``,
    written to ``checkpoint.tmp`` first and renamed into place (the previous one is kept until then)."""
    tmp, ck, old = out / "checkpoint.tmp", out / "checkpoint", out / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.detach().float().cpu().clone().contiguous() for k, v in model.state_dict().items()},
              tmp / "model.safetensors")
    state = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            v = v if torch.is_tensor(v) else torch.tensor(v)
            state[f"{i}.{k}"] = v.detach().float().cpu().contiguous()
    save_file(state, tmp / "optimizer.safetensors")
    rng = {"cpu": torch.get_rng_state()}
    device = next(model.parameters()).device
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    save_file(rng, tmp / "rng.safetensors")
    (tmp / "progress.json").write_text(json.dumps(progress) + "\n")
    shutil.rmtree(old, ignore_errors=True)
    if ck.exists():
        ck.rename(old)
    tmp.rename(ck)
    shutil.rmtree(old, ignore_errors=True)


def find_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint (a kill between the two renames leaves only ``checkpoint.old``)."""
    for name in ("checkpoint", "checkpoint.old"):
        if (out / name / "progress.json").exists():
            return out / name
    return None


def load_checkpoint(ck: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Restore weights, optimizer and RNG state from ``ck``; returns its progress."""
    device = next(model.parameters()).device
    model.load_state_dict({k: v.to(device) for k, v in load_file(ck / "model.safetensors").items()})
    sd = opt.state_dict()
    for key, v in load_file(ck / "optimizer.safetensors").items():
        i, k = key.split(".", 1)
        sd["state"].setdefault(int(i), {})[k] = v if k == "step" else v.to(device)
    opt.load_state_dict(sd)
    rng = load_file(ck / "rng.safetensors")
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"], device)
    return json.loads((ck / "progress.json").read_text())


def check_resumable(out: Path, recipe: LMRecipe, what: dict) -> None:
    """Refuse to resume a checkpoint made with another recipe or other inputs (``what``: e.g. the data's
    size and the target)."""
    ck = find_checkpoint(out)
    if ck is None:
        return
    saved = json.loads((ck / "progress.json").read_text())
    mine = {"recipe": {k: v for k, v in json.loads(json.dumps(recipe.to_dict())).items() if k != "checkpoint_every"},
            **json.loads(json.dumps(what))}
    theirs = {"recipe": {k: v for k, v in saved.get("recipe", {}).items() if k != "checkpoint_every"},
              **{k: saved.get(k) for k in what}}
    if mine != theirs:
        diff = sorted(k for k in set(mine["recipe"]) | set(theirs["recipe"])
                      if mine["recipe"].get(k) != theirs["recipe"].get(k)) + \
            sorted(k for k in what if mine[k] != theirs[k])
        raise InputError(f"{out} holds a checkpoint of another run (differs in: {', '.join(diff)}): "
                         "use another --out or --overwrite")


# ---------------------------------------------------------------------------------------------- training


@torch.no_grad()
def validation_loss(model: torch.nn.Module, examples: list[Example], loss_fn: LossFn, recipe: LMRecipe) -> dict:
    """The loss and metrics over held-out examples (token-weighted by batch), model left in eval mode."""
    model.eval()
    device = next(model.parameters()).device
    totals: dict[str, float] = {}
    weight = 0
    for idx in make_batches(examples, recipe.tokens_per_batch, recipe.seed):
        ids, attn, mask = collate(examples, idx, device)
        with _autocast(device):
            loss, metrics = loss_fn(model, ids, attn, mask)
        n = int((mask & attn)[:, 1:].sum())
        for k, v in {"loss": float(loss), **metrics}.items():
            totals[k] = totals.get(k, 0.0) + float(v) * n
        weight += n
    return {f"val_{k}": round(v / max(1, weight), 5) for k, v in totals.items()}


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def train_lm(model: torch.nn.Module, examples: list[Example], val: list[Example], loss_fn: LossFn,
             recipe: LMRecipe, out: Path, resume: bool, what: dict, stop_after_s: float | None = None,
             note: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> tuple[list, bool]:
    """Train ``model``'s parameters (those with requires_grad) in place on ``examples``; checkpoints go to
    ``out/checkpoint`` every ``checkpoint_every`` steps, at each epoch end, when ``stop_after_s`` seconds of
    this call are spent and on Ctrl-C (then the interrupt goes on). ``what`` is stored with the checkpoint
    (see :func:`check_resumable`). Returns (per-epoch log, finished); one JSON line per epoch on stdout."""
    if not examples:
        raise InputError("no training examples (no conversation has an answer within max_len tokens)")
    device = next(model.parameters()).device
    torch.manual_seed(recipe.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)
    per_epoch = len(make_batches(examples, recipe.tokens_per_batch, recipe.seed))
    total = per_epoch * recipe.epochs if not recipe.max_steps else min(per_epoch * recipe.epochs, recipe.max_steps)
    step, log, train_s = 0, [], 0.0
    ck = find_checkpoint(out) if resume else None
    if ck is not None:
        progress = load_checkpoint(ck, model, opt)
        step, log, train_s = progress["step"], progress["log"], progress["train_s"]
        note(f"resuming at step {step} of {total}")
    started = time.perf_counter()

    def save() -> None:
        save_checkpoint(out, model, opt, {"step": step, "total": total, "log": log, "recipe": recipe.to_dict(),
                                          "train_s": round(train_s + time.perf_counter() - started, 1), **what})

    model.train()
    try:
        for epoch in range(step // per_epoch, recipe.epochs):
            if step >= total:
                break
            batches = make_batches(examples, recipe.tokens_per_batch, recipe.seed + epoch)
            sums: dict[str, torch.Tensor] = {}
            count, t0 = 0, time.perf_counter()
            for idx in batches[step - epoch * per_epoch:]:
                ids, attn, mask = collate(examples, idx, device)
                for group in opt.param_groups:
                    group["lr"] = lr_at(step, total, recipe)
                with _autocast(device):
                    loss, metrics = loss_fn(model, ids, attn, mask)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip)
                opt.step()
                step += 1
                count += 1
                for k, v in {"loss": loss.detach(), **metrics}.items():
                    sums[k] = sums.get(k, 0.0) + v.detach().float()
                if step % 20 == 0 or step == total:
                    note(f"step {step}/{total} loss {float(sums['loss']) / count:.4f} "
                         f"({(time.perf_counter() - t0) / count:.2f} s/step)")
                if step >= total:
                    break
                if stop_after_s is not None and time.perf_counter() - started >= stop_after_s:
                    save()
                    model.eval()
                    return log, False
                if step % recipe.checkpoint_every == 0:
                    save()
            entry = {"epoch": epoch + 1, "step": step, **{k: round(float(v) / max(1, count), 5) for k, v in sums.items()},
                     "seconds": round(time.perf_counter() - t0, 1)}
            if val:
                entry.update(validation_loss(model, val, loss_fn, recipe))
                model.train()
            log.append(entry)
            print(json.dumps(entry), flush=True)
            save()
    except KeyboardInterrupt:
        save()
        model.eval()
        raise
    model.eval()
    return log, True


def read_train_seconds(out: Path) -> float | None:
    """The training seconds of the run in ``out`` over all its calls, as its last checkpoint counts them."""
    ck = find_checkpoint(out)
    return json.loads((ck / "progress.json").read_text())["train_s"] if ck else None


# ------------------------------------------------------------------------------------------------ export


def export_model(model: torch.nn.Module, tokenizer, out: Path, name: str, recipe: LMRecipe, log: list,
                 card: str, extra: dict) -> Path:
    """A complete transformers model folder ``out/name`` (config, safetensors weights in ``save_dtype``,
    tokenizer files, generation config) plus ``recipe.json``, ``training.json`` (log and ``extra``) and a
    model card ``README.md``; written to ``name.tmp`` and renamed into place."""
    final, tmp = out / name, out / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = torch.bfloat16 if recipe.save_dtype == "bfloat16" else torch.float32
    copy.deepcopy(model).to("cpu", dtype).save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2) + "\n")
    (tmp / "training.json").write_text(json.dumps({"log": log, **extra}, indent=2) + "\n")
    (tmp / "README.md").write_text(card)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def run_command(run, args, stage: str) -> int:
    """A training command's exit status: ``run(args)``'s, or 2 with one line for our errors, or 130 with
    where to resume after Ctrl-C (``stage``: what had started, e.g. "training")."""
    from fsd_eagle.errors import FSDError

    try:
        return run(args)
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: the checkpoint (if {stage} had started) is in OUT/checkpoint; continue with "
              "--resume", file=sys.stderr)
        return 130


def add_run_options(p, stage: str) -> None:
    """The options every model-training command shares (``stage``: what runs, e.g. "training")."""
    p.add_argument("--max-steps", type=int, help=f"cap on the {stage} steps (the LR schedule is fitted to it)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default as for generate)")
    p.add_argument("--resume", action="store_true", help=f"continue the {stage} from OUT/checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete OUT's previous run first")
    p.add_argument("--stop-after", type=float,
                   help=f"end this call after that many seconds of {stage}, with a checkpoint to --resume from")

