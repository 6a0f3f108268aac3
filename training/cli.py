"""The trainer's command line (``python -m training``, see training/__main__.py): ``run RECIPE --out DIR``
trains a draft head end to end (data -> optional self-distillation -> online features -> training ->
validation tau -> export); ``data prepare ...`` builds a conversation file (see training/data.py);
``rank`` writes a head's token ranking; ``finetune RECIPE --out DIR`` fine-tunes a target (training/finetune.py);
``draft-model --target DIR --layers K --out DIR`` builds and distills a small draft LM (training/draft_model.py)."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.cli import OneLineParser, quiet_transformers
from fsd_eagle.config import TreeConfig
from fsd_eagle.errors import ConfigError, FSDError, HeadMismatchError, InputError
from fsd_eagle.head import EagleHead, HeadConfig, check_fit
from fsd_eagle.jsonl import write_text_atomic
from fsd_eagle.outputs import check_replaceable, clear_folder, mark_ours
from fsd_eagle.models import (check_threads, head_weights_sha256, load_head, load_target, resolve_device,
                               resolve_dtype, set_threads)
from fsd_eagle.target import Target

from .data import main as data_main, read_conversations, write_conversations
from .distill import conversation_of
from .features import rank_tokens, tokenize_conversation
from .fingerprint import FINGERPRINT_FILE, check_resume, run_fingerprint, write_fingerprint
from .recipe import Recipe, field_problem
from .ddp import Ranks, barrier, join, leave
from .train import checkpoint_dir, export_head, train

PARTIAL_HEAD = "head-partial"  # where Ctrl-C exports the head trained so far
DISTILL_JOURNAL = "distill-journal"  # self-distilled answers batch by batch, until the cache holds them


def _is_val(conv_id: str, fraction: float) -> bool:
    return int(hashlib.sha1(conv_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < fraction


_TOKENIZER = None


def _init_worker(path: str) -> None:
    global _TOKENIZER
    from transformers import AutoTokenizer
    _TOKENIZER = AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def _tokenize(args):
    messages, max_len = args
    return tokenize_conversation(_TOKENIZER, messages, max_len)


def note(message: str) -> None:
    """A progress line on stderr (stdout carries the run's JSON lines); in a data-parallel run, process 0's
    alone (its RANK is 0 or unset)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        print(message, file=sys.stderr, flush=True)


def tokenize_all(tokenizer, tokenizer_dir: str, convs, max_len: int, workers: int):
    jobs = [(c.messages, max_len) for c in convs]
    note(f"tokenizing {len(jobs)} conversations (chat template, assistant-token masks)")
    if workers <= 1 or len(jobs) < 1000:
        return [e for e in (tokenize_conversation(tokenizer, m, n) for m, n in jobs) if e is not None]
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(tokenizer_dir,)) as pool:
        return [e for e in pool.map(_tokenize, jobs, chunksize=64) if e is not None]


def check_out(out: Path, resume: bool, overwrite: bool, inputs: Sequence = ()) -> None:
    """Fail before any work if ``out`` cannot take this run (nothing is written or deleted here): with
    ``overwrite``, ``out`` must be a run folder of ours that holds none of the run's ``inputs``."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out} is a file, not a folder")
    if out.exists() and any(out.iterdir()) and not (resume or overwrite):
        raise InputError(f"{out} already holds a training run: pass --resume to continue it or --overwrite")
    if overwrite:
        check_replaceable(out, inputs, "--overwrite", legacy=(FINGERPRINT_FILE,))


def prepare_out(out: Path, resume: bool, overwrite: bool, inputs: Sequence = ()) -> None:
    check_out(out, resume, overwrite, inputs)
    if overwrite:
        clear_folder(out, inputs, "--overwrite", legacy=(FINGERPRINT_FILE,))
    out.mkdir(parents=True, exist_ok=True)
    mark_ours(out, "training run")


def run_inputs(recipe: Recipe, recipe_path: str | None) -> list:
    """The files and folders a training run reads: --overwrite never removes a folder holding one."""
    return [*recipe.data, *recipe.extra_distilled, recipe.target, recipe.init, recipe_path]


_DISTILL_KEYS = ("distill_count", "distill_turns", "distill_prompt_tokens", "distill_new_tokens",
                 "distill_temperature", "distill_samples")
#: what a cache whose settings file predates a setting was made with: the recipe's defaults (greedy, one answer)
_DISTILL_DEFAULTS = {k: Recipe.__dataclass_fields__[k].default for k in ("distill_temperature", "distill_samples")}


def _distill_settings(recipe: Recipe) -> dict:
    return {k: getattr(recipe, k) for k in _DISTILL_KEYS}


def cached_distill_settings(out: Path, recipe: Recipe) -> dict | None:
    """The settings of the run folder's distilled answers (None without a cache). A cache without its
    settings file comes from an older run, which distilled first turns only: taken as made with the
    recipe's other settings."""
    if not (out / "distilled.jsonl.gz").exists():
        return None
    made_with = out / "distilled.json"
    if made_with.exists():
        return {**_DISTILL_DEFAULTS, **json.loads(made_with.read_text())}
    return {**_distill_settings(recipe), **_DISTILL_DEFAULTS, "distill_turns": 1}


def check_distilled(out: Path, recipe: Recipe) -> None:
    """Refuse a run folder whose distilled answers were made with other settings, unless only with fewer
    turns (they are then extended)."""
    settings = cached_distill_settings(out, recipe)
    if not recipe.distill or settings is None:
        return
    wanted = _distill_settings(recipe)
    if {**settings, "distill_turns": wanted["distill_turns"]} != wanted or settings["distill_turns"] > wanted["distill_turns"]:
        raise InputError(f"{out / 'distilled.jsonl.gz'} was distilled with other settings ({settings}): "
                         "use another --out or --overwrite")


def distilled_answers(out: Path, recipe: Recipe, model, tokenizer, train_convs: list, timings: dict,
                      ranks: Ranks = Ranks()) -> list:
    """The target's own answers to the training conversations: from the run folder's cache, made now
    (self-distillation of the first ``distill_count`` conversations; shared by data-parallel processes), or
    the cache extended to more turns; what is made is cached with its settings (by process 0)."""
    cache = out / "distilled.jsonl.gz"
    settings = cached_distill_settings(out, recipe)
    cached = list(read_conversations(cache)) if settings else []
    if settings == _distill_settings(recipe):
        return cached
    from .distill import distill_shared
    t = time.perf_counter()
    pool = train_convs[: recipe.distill_count or None]
    first = settings["distill_turns"] + 1 if settings else 1
    turns = f"turn {first}" if first == recipe.distill_turns else f"turns {first}-{recipe.distill_turns}"
    how = (f"{recipe.distill_samples} answers each sampled at temperature {recipe.distill_temperature:g}, "
           if recipe.distill_temperature > 0 else "")
    shared = f", shared by {ranks.world} processes" if ranks.parallel else ""
    note(f"self-distillation: the target answers {len(pool)} conversations ({turns}, {how}up to "
         f"{recipe.distill_new_tokens} new tokens, batches of {recipe.distill_batch}{shared}); cached in {cache}")
    journal = out / DISTILL_JOURNAL  # each batch as it is made: an interrupted distillation goes on from there
    distilled = distill_shared(ranks, model, tokenizer, pool, recipe.distill_batch, recipe.distill_prompt_tokens,
                               recipe.distill_new_tokens, recipe.distill_turns, cached,
                               settings["distill_turns"] if settings else 0, recipe.distill_temperature,
                               recipe.distill_samples, recipe.seed, journal=journal, cache=recipe.distill_cache)
    if ranks.is_main:
        write_conversations(distilled, cache)
        write_text_atomic(out / "distilled.json", json.dumps(_distill_settings(recipe)) + "\n")
        shutil.rmtree(journal, ignore_errors=True)  # its answers are in the cache now
    timings["distill_s"] = round(time.perf_counter() - t, 1)
    return distilled


def read_extra_distilled(paths: list[str]) -> list:
    """The conversations of ``extra_distilled`` files, each checked to be the target's answers (a run
    folder's ``distilled.jsonl.gz``: every source "distill:..."), with a one-line error otherwise."""
    convs = []
    for path in paths:
        found = list(read_conversations(Path(path)))
        if not found:
            raise InputError(f"extra distilled answers {path} hold no conversation")
        other = next((c for c in found if not c.source.startswith("distill:")), None)
        if other is not None:
            raise InputError(f"extra distilled answers {path}: conversation {other.id} is not the target's answer "
                             f"(source {other.source!r}); give a run folder's distilled.jsonl.gz")
        convs += found
    return convs


def add_extra_distilled(distilled: list, extra: list, val_fraction: float) -> tuple[list, int]:
    """``distilled`` followed by the ``extra`` answers that are neither held out (by their conversation's
    id: a sampled answer's id is ``<id>#<s>``) nor already present with the same messages; returns them
    and how many extra answers were added."""
    seen = {json.dumps(c.messages, sort_keys=True) for c in distilled}
    added = []
    for c in extra:
        key = json.dumps(c.messages, sort_keys=True)
        if _is_val(conversation_of(c.id), val_fraction) or key in seen:
            continue
        seen.add(key)
        added.append(c)
    return distilled + added, len(added)


def recipe_of(args: argparse.Namespace) -> Recipe:
    """The recipe file with the command line's values over it, every value checked (before any work)."""
    recipe = Recipe.load(args.recipe)
    if args.target:
        recipe.target = args.target
    for key in ("epochs", "distill_count", "distill_batch", "distill_turns", "distill_temperature", "distill_samples",
                "distill_cache", "answers", "init", "unroll", "arch", "layers", "draft_vocab_size",
                "head_intermediate_size", "max_steps"):
        if getattr(args, key) is not None:
            problem = field_problem(key, getattr(args, key))
            if problem:
                raise InputError(f"--{key.replace('_', '-')} {problem}")
            setattr(recipe, key, getattr(args, key))
    if args.cudnn_attention is not None:
        recipe.cudnn_attention = args.cudnn_attention == "on"
    if args.compile is not None:
        recipe.compile = args.compile == "on"
    check_threads(args.threads)
    if args.data:
        recipe.data = args.data
    if args.extra_distilled:
        recipe.extra_distilled = args.extra_distilled
    recipe.validate(f"recipe {args.recipe}")
    if not recipe.data:
        raise InputError("no training data: give --data FILE (from 'python -m training data prepare') or set it in the recipe")
    check_options(args)
    return recipe


def check_options(args: argparse.Namespace) -> None:
    """The command line's own numbers: workers, and the time budget / stop-after seconds."""
    if not 1 <= args.workers <= 1024:
        raise InputError(f"--workers must be between 1 and 1024, got {args.workers}")
    if args.time_budget is not None and not (math.isfinite(args.time_budget) and args.time_budget > 0):
        raise InputError(f"--time-budget must be a finite number of seconds > 0, got {args.time_budget}")
    if args.stop_after is not None and not (math.isfinite(args.stop_after) and args.stop_after >= 0):
        raise InputError(f"--stop-after must be a finite number of seconds >= 0, got {args.stop_after}")


def head_config(recipe: Recipe, target_config, where: str) -> HeadConfig:
    """The head the recipe trains for the target: eagle2, or eagle3 over the recipe's layers (default:
    HeadConfig's) with a draft vocabulary of ``draft_vocab_size`` tokens (0: the whole vocabulary); its MLP
    ``head_intermediate_size`` wide (0: the target's); a setting the target cannot take is refused with one
    line that names ``where`` it comes from."""
    width = {"intermediate_size": recipe.head_intermediate_size} if recipe.head_intermediate_size else {}
    if recipe.arch == "eagle2":
        return HeadConfig.for_target(target_config, **width)
    try:
        cfg = HeadConfig.for_target(target_config, arch="eagle3", layers=tuple(recipe.layers),
                                    draft_vocab_size=recipe.draft_vocab_size, **width)
    except ConfigError as e:
        raise InputError(f"{where}: {e}") from None
    check_fit(cfg, target_config, f"{where}: the eagle3 head")
    return cfg


def run(args: argparse.Namespace) -> int:
    recipe = recipe_of(args)
    quiet_transformers()  # stderr: our progress bars and one-line errors, not transformers' loading bars
    out = Path(args.out)
    inputs = run_inputs(recipe, args.recipe)
    check_out(out, args.resume, args.overwrite, inputs)
    if not args.overwrite:
        check_distilled(out, recipe)
    # Every input is read before ``out`` is created or cleared, so bad input leaves nothing behind.
    convs = [c for path in recipe.data for c in read_conversations(Path(path))]
    if not convs:
        raise InputError("the training data holds no conversation")
    extra = read_extra_distilled(recipe.extra_distilled)
    ranks, device = join(resolve_device(args.device))  # several processes under torchrun: data parallel
    set_threads(args.threads, device)
    note(f"loading the target ({recipe.target or 'the default SmolLM2-135M-Instruct'}) on {device}"
         + (f", one of {ranks.world} data-parallel processes" if ranks.parallel else ""))
    model, tokenizer = load_target(recipe.target, device, resolve_dtype(args.dtype, device))
    torch.manual_seed(recipe.seed)  # the head's initial weights, whatever ran before in this process
    head = EagleHead(head_config(recipe, model.config.get_text_config(), f"recipe {args.recipe}"))
    if recipe.init:
        init = load_head(recipe.init, model.config.get_text_config(), torch.device("cpu"), torch.float32).state_dict()
        if {k: v.shape for k, v in init.items()} != {k: v.shape for k, v in head.state_dict().items()}:
            raise HeadMismatchError(f"the head in {recipe.init} has another shape than this trainer's head for the target")
        head.load_state_dict(init)
    tok_dir = str(Path(recipe.target) if recipe.target else Path(model.config._name_or_path))
    fingerprint = run_fingerprint(recipe, Path(tok_dir))
    if args.resume and not args.overwrite and out.is_dir():
        check_resume(out, fingerprint)
    barrier(ranks)  # every process has checked the folder before process 0 prepares it
    if ranks.is_main:
        prepare_out(out, args.resume, args.overwrite, inputs)
        write_fingerprint(out, fingerprint)
    barrier(ranks)
    started = {}  # what an interrupted run can still export (filled once training starts)
    try:
        status = _run(args, recipe, out, convs, extra, device, model, tokenizer, head, tok_dir, started, ranks)
    except KeyboardInterrupt:
        return interrupted(out, recipe, head, started) if ranks.is_main else 130
    leave(ranks)
    return status


def _run(args, recipe: Recipe, out: Path, convs: list, extra: list, device: torch.device, model, tokenizer,
         head: EagleHead, tok_dir: str, started: dict, ranks: Ranks = Ranks()) -> int:
    val = [c for c in convs if _is_val(c.id, recipe.val_fraction)]
    train_convs = [c for c in convs if not _is_val(c.id, recipe.val_fraction)]
    timings = {}
    distilled = distilled_answers(out, recipe, model, tokenizer, train_convs, timings, ranks) if recipe.distill else []
    made = len(distilled)
    counts = {}
    if extra:
        distilled, counts["extra_distilled"] = add_extra_distilled(distilled, extra, recipe.val_fraction)
    if recipe.distill or extra:
        train_convs = {"both": train_convs + distilled, "distilled": distilled, "original": train_convs}[recipe.answers]
    if args.stage == "distill":
        if ranks.is_main:
            print(json.dumps({"distilled": made, **counts, **timings}))
        return 0
    t = time.perf_counter()
    examples = tokenize_all(tokenizer, tok_dir, train_convs, recipe.max_len, args.workers)
    n_tokens = sum(int(e.mask.sum()) for e in examples)
    timings["tokenize_s"] = round(time.perf_counter() - t, 1)
    if head.config.eagle3 and not recipe.init:  # a warm start keeps its head's draft vocabulary
        head.set_draft_vocab(rank_tokens(examples, head.config.vocab_size))
    if ranks.is_main:
        print(json.dumps({"conversations": len(train_convs), **counts, "examples": len(examples),
                          "loss_tokens": n_tokens, "val_prompts": len(val), **timings}), flush=True)
    target = Target(model)
    head = head.to(device)
    val_prompts = [c.messages[: next(i for i, m in enumerate(c.messages) if m["role"] == "user") + 1]
                   for c in val[: recipe.val_prompts]]

    def validate(h: EagleHead, deadline: float | None = None) -> dict:
        """tau of greedy decoding with the default tree on the held-out prompts; with a deadline (the time
        budget's end), the prompts decoded before it (at least one)."""
        gen = SpeculativeGenerator(model, tokenizer, copy.deepcopy(h).to(model.dtype).eval(), tree=TreeConfig())
        forwards = tokens = done = 0
        for msgs in tqdm(val_prompts, desc="validation (tau)", unit="prompt", leave=False):
            if done and deadline is not None and time.perf_counter() >= deadline:
                break
            r = gen.generate(msgs, recipe.val_new_tokens)
            forwards, tokens, done = forwards + r.stats.target_forwards, tokens + r.stats.new_tokens, done + 1
        result = {"val_tau": round(tokens / max(1, forwards), 3)}
        if done < len(val_prompts):
            result["val_prompts_decoded"] = done
        return result

    extra = {"examples": len(examples), "loss_tokens": n_tokens,
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if ranks.parallel:
        extra["data_parallel_processes"] = ranks.world
    started.update(examples=examples, vocab_size=target.vocab_size, extra=extra, timings=timings)
    t = time.perf_counter()
    log, finished = train(target, head, examples, recipe, out, resume=args.resume,
                          validate=validate if val_prompts else None, time_budget_s=args.time_budget,
                          stop_after_s=args.stop_after, ranks=ranks)
    if not ranks.is_main:
        return 0  # process 0 reports and exports
    call_s = round(time.perf_counter() - t, 1)
    # the whole run's training time (over resumed calls too), as the checkpoint counts it
    timings["train_s"] = json.loads((checkpoint_dir(out) / "progress.json").read_text())["train_s"]
    if not finished:
        print(json.dumps({"stopped": True, "call_train_s": call_s, **timings, "checkpoint": str(out / "checkpoint"),
                          "continue": "run the same command with --resume"}))
        return 0
    if recipe.init:  # which weights the warm start began from (the init folder may change later)
        timings["init_sha256"] = head_weights_sha256(Path(recipe.init))
    head.token_ranking = rank_tokens(examples, target.vocab_size)
    final = export_head(head, out, recipe, log, {**extra, **timings})
    shutil.rmtree(out / PARTIAL_HEAD, ignore_errors=True)  # an interrupted call's head, now superseded
    print(json.dumps({"head": str(final), **timings, "final": log[-1] if log else None}))
    return 0


def interrupted(out: Path, recipe: Recipe, head: EagleHead, started: dict) -> int:
    """Ctrl-C: one line on stderr saying what was kept. Once training has started, train() has saved a
    checkpoint; the head so far is also exported, to OUT/head-partial. Exit status 130."""
    ck = checkpoint_dir(out)
    if ck is None or "examples" not in started:
        kept = ck is not None or (out / "distilled.jsonl.gz").exists() or (out / DISTILL_JOURNAL).is_dir()
        again = "with --resume to continue" if kept else "again"
        print(f"\ninterrupted before training started: run the same command {again}", file=sys.stderr, flush=True)
        return 130
    progress = json.loads((ck / "progress.json").read_text())
    head.token_ranking = rank_tokens(started["examples"], started["vocab_size"])
    partial = export_head(head, out, recipe, progress["log"],
                          {**started["extra"], **started["timings"], "train_s": progress["train_s"],
                           "interrupted_at_step": progress["step"]}, name=PARTIAL_HEAD)
    print(f"\ninterrupted at step {progress['step']} of {progress.get('total', '?')}: checkpoint in {ck}, "
          f"the head so far in {partial}; run the same command with --resume to continue", file=sys.stderr, flush=True)
    return 130


def rank(args: argparse.Namespace) -> int:
    """Write a head folder's token ranking from conversation files (for heads trained before rankings, or
    on other data): the answer tokens of every conversation, as the trainer counts them."""
    from fsd_eagle.head import RANKING_FILE
    from fsd_eagle.models import save_ranking

    head_dir = Path(args.head)
    if not (head_dir / "config.json").exists():
        raise InputError(f"no draft head at {head_dir}")
    if not 1 <= args.workers <= 1024:
        raise InputError(f"--workers must be between 1 and 1024, got {args.workers}")
    problem = field_problem("max_len", args.max_len)
    if problem:
        raise InputError(f"--max-len {problem}")
    convs = [c for path in args.data for c in read_conversations(Path(path))]
    if not convs:
        raise InputError("the conversation files hold no conversation")
    quiet_transformers()
    model, tokenizer = load_target(args.target, torch.device("cpu"), torch.float32)
    tok_dir = str(Path(args.target) if args.target else Path(model.config._name_or_path))
    examples = tokenize_all(tokenizer, tok_dir, convs, args.max_len, args.workers)
    ranking = rank_tokens(examples, model.get_output_embeddings().weight.shape[0])
    save_ranking(ranking, head_dir)
    answers = sum(int(e.mask.sum()) for e in examples)
    print(json.dumps({"ranking": str(head_dir / RANKING_FILE), "conversations": len(convs), "answer_tokens": answers}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "data":
        return data_main(argv[1:])
    if argv and argv[0] == "export":
        from fsd_eagle.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "finetune":
        from .finetune import main as finetune_main

        return finetune_main(argv[1:])
    if argv and argv[0] == "draft-model":
        from .draft_model import main as draft_main

        return draft_main(argv[1:])
    p = OneLineParser(prog="python -m training", description="train an EAGLE draft head")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train a head from a recipe")
    r.add_argument("recipe")
    r.add_argument("--out", required=True)
    r.add_argument("--target", help="local target folder (overrides the recipe)")
    r.add_argument("--data", action="append", help="conversation file(s) (override the recipe)")
    r.add_argument("--epochs", type=int)
    r.add_argument("--distill-count", type=int)
    r.add_argument("--distill-batch", type=int,
                   help="conversations the target answers at once in self-distillation (default: the recipe's); "
                        "larger batches spread generate's per-step host time over more answers, as memory allows")
    r.add_argument("--distill-turns", type=int, help="regenerate the first N assistant turns (default: the recipe's)")
    r.add_argument("--distill-temperature", type=float,
                   help="sample the target's answers at this temperature (0: greedy; default: the recipe's)")
    r.add_argument("--distill-samples", type=int,
                   help="answers per conversation, sampled (needs --distill-temperature > 0; default: the recipe's)")
    r.add_argument("--distill-cache", choices=("dynamic", "static"),
                   help="self-distillation's KV cache (default: the recipe's, dynamic); static: every batch one "
                        "shape, which generate compiles once on a GPU")
    r.add_argument("--extra-distilled", action="append", metavar="FILE",
                   help="the target's answers from an earlier run (its distilled.jsonl.gz), trained on beside this "
                        "run's own distilled answers (repeatable; overrides the recipe)")
    r.add_argument("--answers", choices=("both", "distilled", "original"),
                   help="train on the original answers, the target's own (distilled) ones, or both")
    r.add_argument("--stage", choices=("distill", "all"), default="all")
    r.add_argument("--resume", action="store_true")
    r.add_argument("--overwrite", action="store_true")
    r.add_argument("--device")
    r.add_argument("--dtype")
    r.add_argument("--workers", type=int, default=8)
    r.add_argument("--threads", type=int,
                   help="torch CPU threads (default on the CPU: cores - 1, at most 4, at least 1; unless "
                        "OMP_NUM_THREADS is set)")
    r.add_argument("--unroll", type=int,
                   help="train over N steps of the head on its own predictions (training-time test; default: the recipe's)")
    r.add_argument("--init", help="head folder to start from (warm start; overrides the recipe)")
    r.add_argument("--arch", choices=("eagle2", "eagle3"), help="the head to train (default: the recipe's)")
    r.add_argument("--layers", type=int, nargs="+",
                   help="eagle3: the target layers the head reads (default: the recipe's, else low/middle/high)")
    r.add_argument("--draft-vocab-size", type=int,
                   help="eagle3: the head drafts among the N most frequent answer tokens (0: all; default: the recipe's)")
    r.add_argument("--head-intermediate-size", type=int,
                   help="the head's MLP width (0: the target's intermediate size; default: the recipe's)")
    r.add_argument("--max-steps", type=int,
                   help="stop training after N steps, the schedule fitted to them (0: no cap; default: the recipe's)")
    r.add_argument("--cudnn-attention", choices=("on", "off"),
                   help="let SDPA use cuDNN's attention kernel in training (default: the recipe's, off: flash / "
                        "memory-efficient / math only; cuDNN plans each new batch shape anew)")
    r.add_argument("--compile", choices=("on", "off"),
                   help="compile the target's forward and the loss's logits with torch.compile, dynamic shapes "
                        "(default: the recipe's, off; the first batch waits for the compilation)")
    r.add_argument("--time-budget", type=float,
                   help="seconds of training for the whole run (resumed calls included); the schedule is fitted to it")
    r.add_argument("--stop-after", type=float,
                   help="stop this call after that many seconds of training, with a checkpoint to --resume from")
    k = sub.add_parser("rank", help="write a head's token ranking (its draft vocabulary) from conversation files")
    k.add_argument("--head", required=True, help="head folder to write token_ranking.safetensors into")
    k.add_argument("--data", action="append", required=True, help="conversation file(s), e.g. the training data")
    k.add_argument("--target", help="local target folder (default: the default target)")
    k.add_argument("--max-len", type=int, default=1024, help="tokens per conversation, as in training")
    k.add_argument("--workers", type=int, default=8)
    sub.add_parser("data", help="prepare conversation files (python -m training data prepare --help)")
    sub.add_parser("export", help="write a head in another engine's layout (python -m training export --help)")
    sub.add_parser("finetune", help="full fine-tune of a target on conversations (python -m training finetune --help)")
    sub.add_parser("draft-model", help="a draft LM from the target's first layers, distilled "
                                       "(python -m training draft-model --help)")
    args = p.parse_args(argv)
    try:
        return rank(args) if args.command == "rank" else run(args)
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the run folder was touched (loading), or in rank
        print("\ninterrupted", file=sys.stderr)
        return 130

