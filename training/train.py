"""The EAGLE head training loop: online target features; for an eagle2 head SmoothL1 on the next feature
plus soft cross-entropy against the target's next-token distribution with uniform input noise, for an eagle3
head that cross-entropy over its draft vocabulary alone; AdamW with warm-up."""

from __future__ import annotations

import functools
import json
import math
import random
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from fsd_eagle.errors import InputError
from fsd_eagle.head import EagleHead
from fsd_eagle.models import save_head
from fsd_eagle.target import Target

from .ddp import Ranks, average_gradients, check_in_sync, from_main, gather_objects, sum_over
from .features import Example, collate, make_batches, target_features
from .recipe import Recipe


def head_loss(head: EagleHead, target: Target, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor,
              recipe: Recipe) -> tuple[torch.Tensor, dict]:
    """EAGLE's objective, over ``recipe.unroll`` steps of the head on its own predictions (``EagleHead.unroll``;
    1 = EAGLE-1/2's teacher forcing). Step j row t predicts position t + 1 + j; rows count where x_{t+1+j} is
    an assistant token. Step j's loss weighs ``recipe.unroll_decay ** j`` (EAGLE-3: 0.8), normalised to sum 1.

    eagle2: SmoothL1 on f_{t+1+j} (``feature_weight``) plus ``ce_weight`` x the soft cross-entropy of the
    target's lm_head on the prediction against the target's next-token distribution; input features get
    uniform noise (``noise``). eagle3 (EAGLE-3 drops the feature loss): the soft cross-entropy of the head's
    draft-vocabulary logits against the target's next-token distribution restricted to the draft vocabulary
    and renormalised there (tokens outside it get no target mass); a row whose target top token is outside
    the draft vocabulary does not count (the head cannot draft it), as in the published trainer. No noise.
    Returns the loss and metrics: feature loss (0 for eagle3), CE and top-1 accuracy vs the target's top
    token, per step ``[steps]``. ``recipe.compile``: the target's forward and the cross-entropy's logits run
    compiled (``loss_parts``)."""
    steps, eagle3 = recipe.unroll, head.config.eagle3
    parts = loss_parts(recipe.compile)
    f, states = parts.features(target, ids, attn, head.config.layers)
    if eagle3:
        f_in = states[:, :-1]
    else:
        f_in = f[:, :-1]
        if recipe.noise > 0:
            f_in = f_in + (torch.rand_like(f_in) - 0.5) * recipe.noise
    # Later steps read tokens past the sequence's end: pad (those rows never count).
    emb = target.embed(F.pad(ids[:, 1:], (0, steps - 1)))
    preds = head.unroll(emb, f_in.to(emb.dtype), steps)
    # The N counted positions (row b, position t + 1) and the target there, shared by every step: step j's
    # row t - j predicts position t + 1, for t >= j.
    b, t = (mask & attn)[:, 1:].nonzero(as_tuple=True)
    f_next = f[:, 1:][b, t]
    draft = head.draft_ids() if eagle3 else None
    p_top, counted = target_tops(target, f_next, draft, head.t2d if draft is not None else None)
    total = sum(recipe.unroll_decay ** j for j in range(steps))
    weights = [recipe.unroll_decay ** j / total for j in range(steps)]
    q_ins = [pred[b, (t - j).clamp(min=0)] for j, pred in enumerate(preds)]  # [N, h]; rows t < j dropped below
    ce_rows, q_tops = soft_cross_entropy(head, target, torch.stack(q_ins), f_next, draft,  # [steps, N] each
                                         parts.soft_ce_rows)
    loss, feats, ces, accs = 0.0, [], [], []
    for j, q_in in enumerate(q_ins):
        valid = (t >= j) & counted
        ce = _mean(ce_rows[j], valid)
        if eagle3:
            feat, step_loss = torch.zeros_like(ce), ce
        else:
            feat = F.smooth_l1_loss(q_in[valid].float(), f_next[valid].float())
            step_loss = recipe.feature_weight * feat + recipe.ce_weight * ce
        loss = loss + weights[j] * step_loss
        feats.append(feat.detach())
        ces.append(ce.detach())
        accs.append(_mean((q_tops[j] == p_top).float(), valid))
    return loss, {"feat": torch.stack(feats), "ce": torch.stack(ces), "acc": torch.stack(accs)}


# The most elements of a [steps, rows, V] float32 logits block the loss computes at once (4 GiB): a batch
# whose steps x counted rows x vocabulary exceed it is taken in chunks of rows, each recomputed in the backward pass
# (activation checkpointing), so a 262k vocabulary never holds [tokens, V] tensors for a whole batch.
MAX_LOGIT_ELEMENTS = 1 << 30


def row_chunks(rows: int, vocab: int) -> list[slice]:
    """Slices of ``rows`` rows, each at most ``MAX_LOGIT_ELEMENTS // vocab`` long (one slice when all fit)."""
    size = max(1, MAX_LOGIT_ELEMENTS // max(1, vocab))
    return [slice(i, i + size) for i in range(0, rows, size)] or [slice(0, 0)]


@torch.no_grad()
def target_tops(target: Target, f_next: torch.Tensor, draft: torch.Tensor | None,
                t2d: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top token at each row ``[N]`` (a draft column when ``draft`` is given) and whether the
    row counts ``[N]`` (with a draft vocabulary: the target's top token over every token is in it),
    computed in chunks of rows."""
    tops, counted = [], []
    for rows in row_chunks(f_next.shape[0], target.vocab_size):
        logits = target.logits(f_next[rows])  # [r, V]
        if draft is None:
            tops.append(logits.argmax(-1))
            counted.append(torch.ones_like(tops[-1], dtype=torch.bool))
        else:
            counted.append(t2d[logits.argmax(-1)])
            tops.append(logits[:, draft].argmax(-1))
    return torch.cat(tops), torch.cat(counted)


def soft_cross_entropy(head: EagleHead, target: Target, q_in: torch.Tensor, f_next: torch.Tensor,
                       draft: torch.Tensor | None, rows_fn: Callable | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per unroll step and row ``[steps, N]``: the soft cross-entropy of the head's predictions ``q_in``
    ``[steps, N, h]`` against the target's next-token distribution at ``f_next`` ``[N, h]`` (eagle2: both
    through the target's lm_head; eagle3: the head's draft logits against the target's distribution
    restricted to the draft vocabulary and renormalised), and the predictions' top tokens (draft columns for
    eagle3). The target's distribution is computed once per block of rows for every step; over a draft
    vocabulary from its lm_head rows of the draft tokens alone (the same values as the whole vocabulary's
    columns, at a fraction of the cost). Rows are taken in chunks (``row_chunks``), each checkpointed when
    there are several: the same values, without [steps, N, V] tensors kept for backward. ``rows_fn``: what
    computes a block (default ``_soft_ce_rows``; its compiled form from ``loss_parts``)."""
    rows_fn = rows_fn or _soft_ce_rows
    rows_of = None  # eagle3 with a draft vocabulary: the target's lm_head rows of the draft tokens only
    if draft is not None:
        bias = target.lm_head.bias
        rows_of = (target.lm_head.weight[draft], None if bias is None else bias[draft])
    vocab = target.vocab_size if draft is None else draft.numel()
    chunks = row_chunks(q_in.shape[1], vocab * q_in.shape[0])
    if len(chunks) == 1:
        return rows_fn(head, target, rows_of, q_in, f_next)
    parts = [checkpoint(rows_fn, head, target, rows_of, q_in[:, rows], f_next[rows], use_reentrant=False)
             for rows in chunks]
    return torch.cat([ce for ce, _ in parts], 1), torch.cat([top for _, top in parts], 1)


def _soft_ce_rows(head: EagleHead, target: Target, rows_of: tuple | None, q_in: torch.Tensor,
                  f_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``soft_cross_entropy`` of one block of rows, every step (``rows_of``: the target's lm_head rows to use,
    or None)."""
    with torch.no_grad():
        p = (target.logits(f_next) if rows_of is None else target.logits(f_next, *rows_of)).softmax(-1)
    logq = torch.log_softmax(head.draft_logits(q_in) if head.config.eagle3 else target.logits(q_in), dim=-1)
    return -(p * logq).sum(-1), logq.argmax(-1)


@dataclass(frozen=True)
class LossParts:
    """The two costly pieces of a training step's loss: the target's forward (``features``, as
    ``target_features``; about half of a step of the default target's head on a GPU) and one block of rows of
    the soft cross-entropy (``soft_ce_rows``, as ``_soft_ce_rows``: the [steps, N, V] logits and their
    softmax, a chain of memory-bound passes)."""

    features: Callable
    soft_ce_rows: Callable


def loss_parts(compiled: bool) -> LossParts:
    """The loss's pieces eagerly, or compiled by torch.compile (``recipe.compile``, ``--compile on``), which
    fuses the target's norms, rotary embedding and activations and the softmax passes into fewer kernels. A
    batch's [B, T] and its counted rows change nearly every step, so the pieces are compiled with dynamic
    shapes: one compilation serves every batch (a one-row batch, if one comes, compiles once more). The
    values are those of the eager pieces up to floating-point rounding (tests/test_training.py)."""
    return _compiled_loss_parts() if compiled else LossParts(target_features, _soft_ce_rows)


@functools.cache
def _compiled_loss_parts() -> LossParts:
    return LossParts(torch.compile(target_features, dynamic=True), torch.compile(_soft_ce_rows, dynamic=True))


def _mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the ``valid`` rows (0 where none is: no NaN in the loss)."""
    return torch.where(valid, values, 0).sum() / valid.sum().clamp(min=1)


def named_metrics(means: list[float], steps: int, features: bool = True) -> dict:
    """The training loop's metric sums ([loss, feat per step, CE per step, accuracy per step]) by name:
    feat/ce/acc are step 0's (EAGLE's teacher-forced step); with unrolled steps, also each step's. Without
    ``features`` (an eagle3 head, no feature loss) the feat entries are left out."""
    named = {"loss": means[0], "feat": means[1], "ce": means[1 + steps], "acc": means[1 + 2 * steps]}
    if steps > 1:
        for i, key in enumerate(("feat", "ce", "acc")):
            named[f"{key}_by_step"] = means[1 + i * steps:1 + (i + 1) * steps]
    if not features:
        named = {k: v for k, v in named.items() if not k.startswith("feat")}
    return named


def lr_at(step: int, total: int, recipe: Recipe) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    frac = (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps)
    return recipe.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, frac))))


def rng_state(device: torch.device) -> dict:
    """This process's random streams (the input-feature noise draws from them)."""
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def rng_file(rank: int) -> str:
    """The checkpoint file of process ``rank``'s random streams (process 0's keeps the single-process name)."""
    return "rng.safetensors" if rank == 0 else f"rng_{rank}.safetensors"


def save_checkpoint(out: Path, head: EagleHead, opt: torch.optim.Optimizer, step: int, epoch: int, log: list,
                    schedule: dict | None = None, rngs: list[dict] | None = None) -> None:
    """Head + optimizer state as safetensors and progress as JSON, written atomically (tmp + rename).
    ``schedule``: {"total": steps of the LR schedule, "train_s": training seconds so far, "fitted": whether a
    time budget fixed ``total``}, so a resumed run keeps the schedule it started. ``rngs``: every data-parallel
    process's random streams in rank order (default: this process's alone)."""
    ck = out / "checkpoint"
    tmp = out / "checkpoint.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: (v.float() if v.is_floating_point() else v).detach().cpu().contiguous()  # d2t/t2d stay integers
               for k, v in head.state_dict().items()}, tmp / "head.safetensors")
    opt_state = {}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            opt_state[f"{i}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().float().cpu().reshape(v.shape if torch.is_tensor(v) else ())
    save_file(opt_state, tmp / "optimizer.safetensors")
    # The RNG streams (input-feature noise), so a resumed run draws the noise an uninterrupted one would.
    for rank, rng in enumerate(rngs or [rng_state(next(head.parameters()).device)]):
        save_file(rng, tmp / rng_file(rank))
    (tmp / "progress.json").write_text(json.dumps({"step": step, "epoch": epoch, "log": log, **(schedule or {})}))
    old = out / "checkpoint.old"
    if old.exists():
        shutil.rmtree(old)
    if ck.exists():  # keep the previous checkpoint until the new one is in place
        ck.rename(old)
    tmp.rename(ck)
    if old.exists():
        shutil.rmtree(old)


@contextmanager
def interrupts_deferred():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until it ends, then raise KeyboardInterrupt:
    a training step is done whole or not at all, so the checkpoint saved on the interrupt is a step boundary
    (its random streams too) and resuming gives what an uninterrupted run gives. Off the main thread (no
    signals there) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def checkpoint_dir(out: Path) -> Path | None:
    """The newest complete checkpoint (a kill between save_checkpoint's two renames leaves only .old)."""
    for name in ("checkpoint", "checkpoint.old"):
        if (out / name / "progress.json").exists():
            return out / name
    return None


def load_checkpoint(out: Path, head: EagleHead, opt: torch.optim.Optimizer,
                    rank: int = 0) -> tuple[int, int, list, dict]:
    """Restore head, optimizer and process ``rank``'s RNG streams (kept as they are when the checkpoint has
    none for it, e.g. one made by fewer processes); returns (step, epoch, log, schedule) as saved."""
    ck = checkpoint_dir(out)
    head.load_state_dict(load_file(ck / "head.safetensors"))
    flat = load_file(ck / "optimizer.safetensors")
    sd = opt.state_dict()
    for key, v in flat.items():
        i, k = key.split(".", 1)
        sd["state"].setdefault(int(i), {})[k] = v.to(next(head.parameters()).device) if k != "step" else v
    opt.load_state_dict(sd)
    if (ck / rng_file(rank)).exists():
        rng = load_file(ck / rng_file(rank))
        torch.set_rng_state(rng["cpu"])
        device = next(head.parameters()).device
        if device.type == "cuda" and "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"], device)
    prog = json.loads((ck / "progress.json").read_text())
    schedule = {k: prog[k] for k in ("total", "train_s", "fitted", "processes", "epoch_sums", "epoch_count",
                                      "epoch_tokens") if k in prog}
    return prog["step"], prog["epoch"], prog["log"], schedule


def attention_kernels(recipe: Recipe):
    """The SDPA kernels training may use: torch's choice, or with ``recipe.cudnn_attention`` false every
    kernel but cuDNN's. cuDNN's attention (torch's first choice on sm90+ with a recent cuDNN) builds an
    execution plan for each new tensor shape, and nearly every batch of a first epoch has a new [B, T]."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    if recipe.cudnn_attention:
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def train(target: Target, head: EagleHead, train_set: list[Example], recipe: Recipe, out: Path,
          resume: bool = False, validate=None, time_budget_s: float | None = None,
          stop_after_s: float | None = None, ranks: Ranks = Ranks()) -> tuple[list[dict], bool]:
    """Train ``head`` in place; checkpoints in ``out/checkpoint``. Returns (per-epoch log, finished).
    Attention runs on the kernels ``attention_kernels(recipe)`` allows.

    ``ranks``: with several data-parallel processes (training/ddp.py) each takes every ``world``-th batch of
    an epoch (a step is ``world`` batches, an epoch ``len(batches) // world`` steps), gradients are averaged
    before each step, decisions that end or shorten the run are process 0's, and process 0 alone writes
    checkpoints (with every process's random streams) and runs ``validate``.

    ``validate(head, deadline) -> dict`` (optional) runs after each epoch (e.g. tau measured by decoding);
    ``deadline`` is None, or with a time budget the ``time.perf_counter()`` value at which the budget is
    spent (the validation may then stop early).
    ``time_budget_s``: seconds for the whole run, resumed calls and validations included: from step 60 on,
    every 100 steps, the mean step time (validations left out) is measured and the run shortened so that its
    steps and the validations still to come (each as long as the last one) fit (the LR schedule is rescaled
    to the new length, so it still ends decayed); the fitted length is kept in the checkpoint for resumed calls.
    Steps so slow that the budget is spent before step 60 (a CPU run, a large batch) end the run when it is
    spent, with the learning rate where the schedule had it.
    ``stop_after_s``: this call stops after that many seconds with a checkpoint (finished False), to be
    continued with ``resume`` (e.g. a run longer than one job of a time-limited machine).
    On KeyboardInterrupt (Ctrl-C) a checkpoint of the steps done is saved, then the interrupt goes on.
    """
    with attention_kernels(recipe):
        return _train(target, head, train_set, recipe, out, resume, validate, time_budget_s, stop_after_s, ranks)


def _train(target: Target, head: EagleHead, train_set: list[Example], recipe: Recipe, out: Path, resume: bool,
           validate, time_budget_s: float | None, stop_after_s: float | None, ranks: Ranks) -> tuple[list[dict], bool]:
    if not train_set:
        raise InputError("no training examples")
    device = target.device
    torch.manual_seed(recipe.seed)
    random.seed(recipe.seed)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=recipe.lr, betas=recipe.betas, weight_decay=recipe.weight_decay)
    batches_per_epoch = len(make_batches(train_set, recipe.tokens_per_batch, recipe.seed)) // ranks.world
    if batches_per_epoch == 0:
        raise InputError(f"the training set makes fewer batches than the {ranks.world} processes: use fewer "
                         "processes or a smaller tokens_per_batch")
    cap = batches_per_epoch * recipe.epochs  # the recipe's length; a time budget may shorten it
    if recipe.max_steps:
        if cap < recipe.max_steps and ranks.is_main:  # max_steps caps; it does not add epochs
            print(f"note: the run ends after its {recipe.epochs} epoch(s) at step {cap:,} ({batches_per_epoch:,} "
                  f"batches an epoch), before max_steps {recipe.max_steps:,}: give --epochs "
                  f"{math.ceil(recipe.max_steps / batches_per_epoch)} to reach them", file=sys.stderr, flush=True)
        cap = min(cap, recipe.max_steps)
    total = cap
    step, first_epoch, log, schedule = 0, 0, [], {}
    if resume and checkpoint_dir(out) is not None:
        step, first_epoch, log, schedule = load_checkpoint(out, head, opt, ranks.rank)
        if schedule.get("processes", 1) != ranks.world:  # its batches and steps were split for that many
            raise InputError(f"the checkpoint in {out} was made by {schedule.get('processes', 1)} data-parallel "
                             f"process(es): resume it with as many (this run has {ranks.world})")
        if schedule.get("fitted"):  # a time budget set the run's length: keep it (else --epochs may extend it)
            total = schedule["total"]
    elif resume:
        print(f"note: no checkpoint in {out} yet: training starts at step 0", file=sys.stderr, flush=True)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    started, first_step = time.perf_counter(), step
    before_s, fitted = schedule.get("train_s", 0.0), schedule.get("fitted", False)
    deadline = started + time_budget_s - before_s if time_budget_s else None
    val_s = last_val_s = val_s_at_tick = 0.0  # seconds of validation in this call, of the last one, before tick

    def save(epoch_done: int, together: bool = True) -> None:
        """A checkpoint by process 0; ``together``: every process calls this (their random streams go in).
        Mid-epoch, the epoch's running sums go in too, so a resumed epoch logs all of its steps."""
        rngs = gather_objects(rng_state(device), ranks) if together else None
        if ranks.is_main:
            partial = {} if epoch_done != epoch or not count else {
                "epoch_sums": sums.tolist(), "epoch_count": count, "epoch_tokens": tokens}
            save_checkpoint(out, head, opt, step, epoch_done, log,
                            {"total": total, "train_s": round(before_s + time.perf_counter() - started, 1),
                             "fitted": fitted, "processes": ranks.world, **partial}, rngs)

    def validations_until(end: int) -> int:
        """Validations still to come if training ends at step ``end``: at each epoch end before it, and at it."""
        return 1 + sum(1 for e in range(1, recipe.epochs + 1) if step < e * batches_per_epoch < end)

    resume_epoch = epoch = first_epoch  # the epoch a checkpoint saved on Ctrl-C resumes in
    sums, count, tokens, bar = None, 0, 0, None
    try:
        for epoch in range(first_epoch, recipe.epochs):
            resume_epoch = epoch
            resumed_sums = epoch == first_epoch and bool(schedule.get("epoch_count"))
            if step >= total and not resumed_sums:  # (an epoch interrupted after its last step still logs)
                break
            batches = make_batches(train_set, recipe.tokens_per_batch, recipe.seed + epoch)
            mine = batches[ranks.rank::ranks.world][:batches_per_epoch]  # this process's share, equal for all
            skip = step - epoch * batches_per_epoch
            todo = mine[max(0, skip):]
            bar = tqdm(total=max(0, min(len(todo), total - step)), desc=f"epoch {epoch + 1}/{recipe.epochs}",
                       unit="batch", disable=not ranks.is_main)
            bar_from = step
            # Metrics are summed on the device every step (no per-step host sync) and averaged per epoch; a
            # resumed epoch starts from the sums its checkpoint holds.
            sums, count, tokens, t0 = torch.zeros(1 + 3 * recipe.unroll, device=device), 0, 0, time.perf_counter()
            if resumed_sums:
                sums = torch.tensor(schedule["epoch_sums"], device=device)
                count, tokens = schedule["epoch_count"], schedule.get("epoch_tokens", 0)
            for idx in todo:
                with interrupts_deferred():  # a Ctrl-C lands between steps: the checkpoint is a step boundary
                    ids, attn, mask = collate(train_set, idx, device)
                    for group in opt.param_groups:
                        group["lr"] = lr_at(step, total, recipe)
                    with autocast:
                        loss, metrics = head_loss(head, target, ids, attn, mask, recipe)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    average_gradients(head.parameters(), ranks)
                    torch.nn.utils.clip_grad_value_(head.parameters(), recipe.grad_clip)
                    opt.step()
                    step += 1
                    tokens += sum(len(train_set[i].ids) for i in idx)
                    sums += torch.cat([loss.detach().float()[None], metrics["feat"].float(), metrics["ce"].float(),
                                       metrics["acc"].float()])
                    count += 1
                    bar.update(1)
                    if step - first_step == 10:
                        tick, val_s_at_tick = time.perf_counter(), val_s  # the first steps include start-up costs
                    if time_budget_s and step - first_step >= 60 and (step - first_step) % 100 == 60:
                        # Refitted every 100 steps: early steps are slower (allocator growth, kernel autotuning for
                        # new shapes), so one early measurement would end the run well before its budget.
                        per_step = (time.perf_counter() - tick - (val_s - val_s_at_tick)) / (step - first_step - 10)
                        left = time_budget_s - before_s - (time.perf_counter() - started)
                        end = step + max(0, int(left / per_step))
                        if validate is not None and last_val_s:  # keep time for the validations still to come
                            for _ in range(2):
                                end = step + max(0, int((left - validations_until(end) * last_val_s) / per_step))
                        total, fitted = min(cap, from_main(end, ranks, device)), True
                        bar.total = max(0, min(len(todo), total - bar_from))
                    if (deadline is not None and step - first_step < 60 and step < total
                            and from_main(int(time.perf_counter() >= deadline), ranks, device)):
                        total, fitted = step, True  # steps so slow that the budget is spent before the first fit
                    if step >= total:
                        break
                    if stop_after_s is not None and from_main(int(time.perf_counter() - started >= stop_after_s),
                                                              ranks, device):
                        save(epoch)
                        bar.close()
                        head.eval()
                        return log, False
                    if step % 20 == 0:
                        mean = (sums / count).tolist()
                        bar.set_postfix(loss=f"{mean[0]:.3f}", acc=f"{mean[1 + 2 * recipe.unroll]:.3f}",
                                        tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
                    if step % recipe.checkpoint_every == 0:
                        save(epoch)
            bar.close()
            count = int(sum_over(torch.tensor([count], device=device), ranks).item())
            means = (sum_over(sums, ranks) / max(1, count)).tolist()
            entry = {"epoch": epoch + 1, "step": step, **named_metrics(means, recipe.unroll, not head.config.eagle3),
                     "seconds": round(time.perf_counter() - t0, 1)}
            log.append(entry)
            resume_epoch = epoch + 1  # the epoch's steps are done (a Ctrl-C in validation keeps them)
            if validate is not None and ranks.is_main:
                head.eval()
                t = time.perf_counter()
                entry.update(validate(head, deadline))
                last_val_s = time.perf_counter() - t
                val_s += last_val_s
                head.train()
            if ranks.is_main:
                print(json.dumps(entry), flush=True)
            save(epoch + 1)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        save(resume_epoch, together=False)
        head.eval()
        raise
    check_in_sync(head, ranks)
    head.eval()
    return log, True


def export_head(head: EagleHead, out: Path, recipe: Recipe, log: list, extra: dict, name: str = "head") -> Path:
    """The final head in our format (bf16 safetensors) plus its recipe and training log, in ``out/name``."""
    final, tmp = out / name, out / f"{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_head(head, tmp, torch.bfloat16, extra={"training": extra})
    (tmp / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2) + "\n")
    (tmp / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    if final.exists():  # a resumed run replaces the head it exported before
        shutil.rmtree(final)
    tmp.rename(final)  # written whole, then renamed: never a half-written head/ that looks complete
    return final
