"""Tree tuner: choose the draft tree (total_tokens, depth, top_k) that decodes fastest for a target, its head
and a device, per batch size, and write it into the package's presets, ``fsd_eagle/presets.json``.

    python -m trees.tune --device cpu [--target DIR] [--head DIR] [--out fsd_eagle/presets.json]
    python -m trees.tune --device cuda --compile --trees 60/6/10,48/5/8,96/7/10 --validate 8
    python -m trees.tune --device cuda --compile --trees 64/6/8/v16384 --batch-sizes 1,8,32

The second form (shortlist) skips steps 1-3 below: each listed tree is decoded for real as in step 4 and the
fastest kept. Use it on GPUs, where the eagerly timed stage costs of step 1 measure kernel-launch overhead
that CUDA graphs and compiled rounds remove, so the model would rank trees wrongly.

Method (greedy decoding, exact rule):

1. Costs. The target's verify forward (``Target.forward_tree`` over n chain tokens after a ~200-token prefix,
   plus the lm_head over the n rows) for n in COST_SIZES; the head's commit (the root's draft logits);
   synchronized on CUDA; a few sweeps after a warm-up, then one more after each prompt of step 2, so that
   the medians see the same load from other processes as the rest of the run. Draft-step costs per top_k
   are timed during step 2.
2. Acceptance. Each held-out prompt (MT-bench and GSM8K test questions) is decoded autoregressively (its
   rounds timed: the autoregressive round cost); that
   greedy continuation is what every tree is verified against (lossless decoding yields the same tokens
   whatever the tree). The head then walks the continuation one token at a time, as decoding commits it,
   and at every position drafts every candidate tree of the grid (one expansion per top_k serves all depths
   and sizes: a tree's first levels do not depend on its depth). A tree's accepted length at a position is
   its longest root path that matches the continuation, so the decode of any tree can be replayed: rounds
   jump by accepted + 1 tokens, and tau = new tokens / target forwards. After ``--prune-after`` prompts,
   trees whose predicted speed is far below the best stop being drafted.
3. Model. A round costs t_target(n) + (depth - 1) t_step(top_k) + t_build + t_commit(depth + 1) + t_rest,
   t_rest being the rest of an autoregressive round; predicted tokens/s = new tokens / (prefills + rounds).
4. Validation and choice. The ``--finalists`` best predicted trees, the EAGLE-2 default tree and plain
   autoregressive decoding are really decoded (the library's scheduler and Session, every round
   timed) on the first ``--validate`` prompts, back to back per prompt, so that load from other processes
   hits all alike. "Steady" tokens/s counts every round at its decode's median round time (bursts of load
   elsewhere removed). The preset is the drafting tree with the best measured steady tokens/s; its measured
   tokens/s and tau, the baselines, the replayed tau and the model's error are recorded with it.

Batch buckets (``--batch-sizes``, powers of two 1 to 64; default 1). Bucket 1 is the method above: the device
entry's own tree. For each larger bucket B, a few candidates (the bucket-1 winner, trees derived from it by
halving its size, any ``--batch-trees``, and plain autoregressive decoding) are measured through the public
API, ``gen.generate(prompts, batch_size=B)`` over ``max(--batch-fill x B, --validate)`` prompts rounded up to
whole batches (several batches, so that finished rows are refilled as in use):
throughput = new tokens of all prompts / wall time, the candidates in rotating order over
``--batch-repeats`` passes. The fastest, autoregressive decoding included, is written under the device
entry's "batch" object (fsd_eagle.trees_presets documents the format). Without bucket 1 in the list, the
winner is the presets file's current tree for the target and device. Each bucket is written as soon as it is
measured; ``--resume`` keeps the buckets that the same command already wrote (an interrupted run goes on).
``--attention sdpa|flex`` sets the tree attention of compiled rounds (``SpeculativeGenerator.use_attention``);
each candidate's row records the attention its rounds ran with, and the run's commit is recorded (``--code``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from eval.runinfo import git_commit
from fsd_eagle.config import SamplingConfig, TreeConfig
from fsd_eagle.decode import DecodeStats, prefill_bucket
from fsd_eagle.errors import ConfigError
from fsd_eagle.models import default_head_path, head_weights_sha256
from fsd_eagle.schedule import decode
from fsd_eagle.tree import draft_tree
from fsd_eagle.trees_presets import AUTOREGRESSIVE, BUCKETS, model_name, preset_for
from fsd_eagle.verify import AcceptanceRule

GRID_TOTALS = (4, 8, 16, 32, 60, 96)
GRID_DEPTHS = (1, 2, 3, 4, 5, 6, 7)
GRID_TOP_KS = (1, 4, 8, 10)
COST_SIZES = (1, 2, 4, 8, 16, 32, 60, 96)
AR = TreeConfig(total_tokens=1, depth=1, top_k=1)
DEFAULT_TREE = TreeConfig()
#: The package's presets in this checkout (what fsd_eagle.trees_presets reads, shipped in the wheel).
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "fsd_eagle" / "presets.json"


# ----------------------------------------------------------------------------------------------- the grid

def tree_size(total_tokens: int, depth: int, top_k: int) -> int:
    """Nodes (root included) a tree of this shape really has: EAGLE-2 drafts top_k candidates at depth 1 and
    top_k^2 at each later depth, so total_tokens beyond 1 + top_k + (depth - 1) top_k^2 is never reached."""
    return min(total_tokens, 1 + top_k + (depth - 1) * top_k * top_k)


def candidate_grid(totals: Sequence[int] = GRID_TOTALS, depths: Sequence[int] = GRID_DEPTHS,
                   top_ks: Sequence[int] = GRID_TOP_KS) -> list[TreeConfig]:
    """The distinct drafting trees of the grid, each with total_tokens = its real size.

    Left out: shapes deeper than their node count allows (depth > total_tokens - 1: levels that can never
    be kept), and shapes that draw the same tree as one with a smaller top_k: once top_k >= total_tokens - 1,
    the kept nodes (the total_tokens - 1 best by cumulative log-prob; a node's better siblings and its
    ancestors are all better than it) are candidates whatever the top_k, so a larger top_k only costs more.
    """
    best: dict[tuple[int, int, int], TreeConfig] = {}
    for total in totals:
        for depth in depths:
            for k in sorted(set(top_ks)):
                n = tree_size(total, depth, k)
                if n >= 2 and depth <= n - 1:
                    best.setdefault((n, depth, min(k, n - 1)), TreeConfig(total_tokens=n, depth=depth, top_k=k))
    return sorted(best.values(), key=lambda c: (c.top_k, c.depth, c.total_tokens))


# ---------------------------------------------------------------------------------------------- acceptance

def accepted_drafts(tokens: Sequence[int], parents: Sequence[int], continuation: Sequence[int]) -> int:
    """Draft tokens greedy verification accepts: the longest root path of the tree (node 0 = root) whose
    tokens are the first tokens of ``continuation`` (the target's own greedy choices after the root)."""
    child = {(parents[i], tokens[i]): i for i in range(1, len(tokens))}
    node = accepted = 0
    for tok in continuation:
        node = child.get((node, tok))
        if node is None:
            break
        accepted += 1
    return accepted


def rounds(accepts: Sequence[int], length: int) -> list[int]:
    """Replay a decode of ``length`` tokens from per-position accepted drafts (``accepts[t]``: at the round
    whose root is token t of the continuation; the prefill makes token 0). Returns the tokens each round
    makes, its accepted drafts + 1, the last one cut at ``length`` (DecodeStats.accept_lengths, whose last entry
    is not cut)."""
    made, produced = [], 1
    while produced < length:
        made.append(min(accepts[produced - 1] + 1, length - produced))
        produced += made[-1]
    return made


def walk(accepts: Sequence[int], length: int) -> tuple[int, int]:
    """(new tokens, target forwards) of ``rounds``' decode, the prefill counted as one forward, exactly as
    DecodeStats counts them."""
    made = rounds(accepts, length)
    return 1 + sum(made), 1 + len(made)


# ---------------------------------------------------------------------------------------------- cost model

def _interp(table: dict[int, float], x: float) -> float:
    """Piecewise-linear through the measured points, extended linearly beyond them."""
    xs = sorted(table)
    if len(xs) == 1:
        return table[xs[0]]
    if x <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(v for v in xs if v >= x)
        lo = xs[xs.index(hi) - 1]
    return max(0.0, table[lo] + (table[hi] - table[lo]) * (x - lo) / (hi - lo))


@dataclass
class Costs:
    """Seconds: target verify forward + lm_head over n rows; one draft level per top_k; building a tree
    (top-k, rerank; per tree shape, by default 0); the head's commit of P rows with the root's logits; the
    rest of a round (verification, cache compaction, host sync), from autoregressive decoding."""

    target_s: dict[int, float]
    step_s: dict[int, float]
    commit_s: dict[int, float]
    rest_s: float = 0.0
    build_s: dict[TreeConfig, float] = field(default_factory=dict)

    def round_s(self, cfg: TreeConfig) -> float:
        if not cfg.drafts:
            return _interp(self.target_s, 1) + self.rest_s
        return (_interp(self.target_s, cfg.total_tokens) + (cfg.depth - 1) * self.step_s[cfg.top_k]
                + self.build_s.get(cfg, 0.0) + _interp(self.commit_s, cfg.depth + 1) + self.rest_s)

    def to_ms(self) -> dict:
        ms = lambda d: {str(k): round(v * 1e3, 2) for k, v in sorted(d.items())}  # noqa: E731
        return {"target_forward_by_tree_tokens": ms(self.target_s), "draft_step_by_top_k": ms(self.step_s),
                "head_commit_by_rows": ms(self.commit_s), "round_rest": round(self.rest_s * 1e3, 2)}


@dataclass
class Replayed:
    """One prompt's replay for one tree: new tokens, target forwards, and the prompt's prefill seconds."""

    new_tokens: int
    forwards: int
    prefill_s: float


@dataclass
class Run:
    """A real decode: its tokens (EOS included), target forwards, seconds in all, to the first token
    (prefill), and of each later round."""

    tokens: list[int]
    forwards: int
    elapsed_s: float
    prefill_s: float
    round_s: list[float]

    @property
    def steady_s(self) -> float:
        """Seconds with every round at the median round time: insensitive to bursts of load elsewhere."""
        return self.prefill_s + (statistics.median(self.round_s) * len(self.round_s) if self.round_s else 0.0)


def predict(costs: Costs, cfg: TreeConfig, runs: Sequence[Replayed]) -> tuple[float, float]:
    """(tau, predicted tokens/s) of a tree over replayed prompts."""
    new = sum(r.new_tokens for r in runs)
    fwd = sum(r.forwards for r in runs)
    seconds = sum(r.prefill_s + (r.forwards - 1) * costs.round_s(cfg) for r in runs)
    return new / fwd, new / seconds if seconds > 0 else 0.0


def prune(predicted: dict[TreeConfig, float], keep_frac: float, min_keep: int) -> set[TreeConfig]:
    """Trees still worth drafting: predicted tokens/s >= keep_frac x the best, and at least the min_keep best."""
    ranked = sorted(predicted, key=predicted.get, reverse=True)
    if not ranked:
        return set()
    best = predicted[ranked[0]]
    return {c for i, c in enumerate(ranked) if i < min_keep or predicted[c] >= keep_frac * best}


def rotated(items: Sequence, i: int) -> list:
    """``items`` starting at position i (mod its length): the order of pass i, so that each goes first in turn
    and load from other processes hits all alike."""
    return list(items[i % len(items):]) + list(items[: i % len(items)])


def pick(rows: Sequence[dict]) -> dict:
    """The chosen tree among measured ones: drafting trees only, by steady tokens/s (rounds at their median
    time), then by plain tokens/s."""
    drafting = [r for r in rows if r["tree"].drafts]
    if not drafting:
        raise ValueError("no drafting tree was measured")
    return max(drafting, key=lambda r: (r["steady_tokens_per_s"], r["tokens_per_s"]))


# ---------------------------------------------------------------------------------------------- measuring

class SharedSteps:
    """Drafter for one root that computes each level of a top_k expansion once: every tree of that top_k
    drafted from this root reuses it (their first levels are the same whatever the depth or size). Real
    steps are timed into ``times``."""

    def __init__(self, drafter, sync: Callable[[], None], times: list[float]) -> None:
        self.drafter, self.sync, self.times = drafter, sync, times
        self.memo: dict[int, tuple[torch.Tensor, tuple]] = {}

    @property
    def vocab(self):
        return self.drafter.vocab

    def logits(self, states, full=False):
        return self.drafter.logits(states, full)

    def step(self, depth, tokens, states, rows_anc):
        hit = self.memo.get(depth)
        if hit is not None and torch.equal(hit[0], tokens):
            return hit[1]
        self.sync()
        start = time.perf_counter()
        out = self.drafter.step(depth, tokens, states, rows_anc)
        self.sync()
        self.times.append(time.perf_counter() - start)
        self.memo = {d: v for d, v in self.memo.items() if d < depth}
        self.memo[depth] = (tokens.clone(), out)
        return out


_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Tuner:
    """Measurements on one SpeculativeGenerator (its target, head drafter and tokenizer)."""

    def __init__(self, gen, log: Callable[[str], None] = _log) -> None:
        if gen.drafter is None:
            raise SystemExit("error: the tuner needs a draft head (--head) for the target")
        self.gen, self.target, self.drafter, self.log = gen, gen.target, gen.drafter, log
        self.dev = gen.target.device
        self.sync = torch.cuda.synchronize if self.dev.type == "cuda" else (lambda: None)

    def _time(self, fn) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start

    @torch.no_grad()
    def target_costs(self, prefix: Sequence[int], sizes: Sequence[int], repeats: int, warmup: int
                     ) -> dict[int, list[float]]:
        """Timed seconds of a verify forward (forward_tree over an n-token chain, then the lm_head)."""
        t = self.target
        ids = torch.tensor(list(prefix), device=self.dev)
        t.allocate(ids.shape[0] + max(sizes) + 8)
        t.prefill(ids[None])
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for r in range(warmup + repeats):
            for n in sizes:  # sizes interleaved: background load spreads over all of them
                toks = ids[-n:] if n <= ids.shape[0] else ids[torch.arange(n, device=self.dev) % ids.shape[0]]
                depths = torch.arange(n, device=self.dev)
                anc = torch.ones(n, n, dtype=torch.bool, device=self.dev).tril()
                s = self._time(lambda: t.logits(t.forward_tree(toks[None], depths[None], anc[None])))
                if r >= warmup:
                    times[n].append(s)
        return times

    @torch.no_grad()
    def commit_costs(self, prefix: Sequence[int], rows: Sequence[int], repeats: int, warmup: int
                     ) -> dict[int, list[float]]:
        """Timed seconds of the head's commit of P rows (one head forward + the root's draft logits)."""
        t, d = self.target, self.drafter
        ids = torch.tensor(list(prefix), device=self.dev)
        room = ids.shape[0] + (warmup + repeats) * len(rows) + max(rows) + 8
        t.allocate(room)
        feats = t.prefill(ids[None])
        d.allocate(room, TreeConfig(total_tokens=2, depth=1, top_k=1))
        d.prefill(ids[None], feats[:, :-1])
        one = torch.ones(1, dtype=torch.long, device=self.dev)
        times: dict[int, list[float]] = {p: [] for p in rows}
        for r in range(warmup + repeats):
            for p in rows:
                s = self._time(lambda: d.commit(ids[None, -p:], feats[:, -p:], one))
                if r >= warmup:
                    times[p].append(s)
        return times

    @torch.no_grad()
    def decode(self, prompt: list[int], cfg: TreeConfig, max_new_tokens: int, temperature: float = 0.0,
               seed: int = 0) -> "Run":
        """A real decode with this tree (AR: none), greedy or sampled at ``temperature`` with ``seed``, the
        library's scheduler and Session, every round timed; stops after EOS (counted, as
        SpeculativeGenerator counts it)."""
        gen = self.gen
        if cfg.drafts:
            gen.set_tree(cfg.total_tokens, cfg.depth, cfg.top_k, cfg.draft_vocab, cfg.pool)
        rule = AcceptanceRule(SamplingConfig(temperature=temperature))
        # The generator's own session (a captured CUDA graph on GPUs), as generate() decodes.
        session = gen.session(autoregressive=not cfg.drafts, temperature=temperature)
        stats = DecodeStats()
        ids = torch.tensor(prompt, device=self.dev)
        tokens: list[int] = []
        marks = [time.perf_counter()]
        for new in decode(session, ids, max_new_tokens, rule, seed, stats):
            marks.append(time.perf_counter())
            for tok in new:
                tokens.append(tok)
                if tok in gen.eos_ids:
                    break
            if tokens and tokens[-1] in gen.eos_ids:
                break
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        return Run(tokens, stats.target_forwards, marks[-1] - marks[0], gaps[0], gaps[1:])

    @torch.no_grad()
    def continuation(self, prompt: list[int], tokens: Sequence[int]) -> torch.Tensor:
        """The target's features over prompt + the decoded ``tokens`` but the last (what the head reads)."""
        seq = torch.tensor(prompt + list(tokens[:-1]), device=self.dev)
        self.target.allocate(seq.shape[0] + 8)
        return self.target.prefill(seq[None])[0]

    @torch.no_grad()
    def replay(self, prompt: list[int], cont: list[int], feats: torch.Tensor, configs: Sequence[TreeConfig],
               step_times: dict[int, list[float]], build_times: dict[TreeConfig, list[float]]
               ) -> dict[TreeConfig, list[int]]:
        """Accepted drafts of every tree at every position of the continuation (see the module doc)."""
        d, L = self.drafter, len(prompt)
        c = torch.tensor(cont, device=self.dev)
        p = torch.tensor(prompt, device=self.dev)
        dmax = max(cfg.depth for cfg in configs)
        kmax = max(cfg.top_k for cfg in configs)
        d.allocate(L + len(cont) + 8, TreeConfig(total_tokens=2, depth=dmax, top_k=kmax))
        root = d.prefill(torch.cat([p, c[:1]])[None], feats[None, :L])
        by_k: dict[int, list[TreeConfig]] = {}
        for cfg in sorted(configs, key=lambda x: -x.depth):  # deepest first: it computes every level
            by_k.setdefault(cfg.top_k, []).append(cfg)
        accepts = {cfg: [] for cfg in configs}
        one = torch.ones(1, dtype=torch.long, device=self.dev)
        for t in range(len(cont) - 1):
            for k, group in by_k.items():
                shared = SharedSteps(d, self.sync, step_times.setdefault(k, []))
                for cfg in group:
                    before = len(shared.times)
                    self.sync()
                    start = time.perf_counter()
                    tree = draft_tree(shared, c[t: t + 1], root.logits, root.state, cfg)
                    self.sync()
                    build_times.setdefault(cfg, []).append(time.perf_counter() - start - sum(shared.times[before:]))
                    tokens, parents = tree.tokens[0].tolist(), tree.parents[0].tolist()
                    accepts[cfg].append(accepted_drafts(tokens, parents, cont[t + 1: t + 1 + cfg.depth]))
            root = d.commit(c[None, t + 1: t + 2], feats[None, L + t: L + t + 1], one)
        return accepts


# ---------------------------------------------------------------------------------------------- the run

def held_out_prompts(n: int) -> list[tuple[str, str]]:
    """(source, user message): MT-bench first turns (one per category, in turn) and GSM8K test questions,
    alternating until MT-bench runs out; neither was in the head's training data."""
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from eval.tasks import gsm8k_prompt, load_gsm8k, load_mt_bench

    mt = load_mt_bench()
    by_cat: dict[str, list] = {}
    for q in mt:
        by_cat.setdefault(q.category, []).append(q)
    mt_order = [qs[i] for i in range(10) for qs in by_cat.values() if i < len(qs)]
    gsm = load_gsm8k("test", limit=n)
    out, next_gsm = [], iter(gsm)
    for i in range(n):
        if i % 2 == 0 and i // 2 < len(mt_order):
            out.append((f"mt_bench/{mt_order[i // 2].question_id}", mt_order[i // 2].turns[0]))
        else:  # GSM8K in turn, and alone once MT-bench's 80 are used up
            q = next(next_gsm)
            out.append((f"gsm8k_test/{q.index}", gsm8k_prompt(q)))
    return out


def measure_trees(tuner: "Tuner", prompts: Sequence[list[int]], trial: Sequence[TreeConfig], max_new_tokens: int,
                  log: Callable[[str], None] = _log, temperature: float = 0.0
                  ) -> tuple[dict[TreeConfig, list["Run"]], list[dict]]:
    """Decode every prompt with every tree of ``trial`` (AR first in it), back to back per prompt and in
    rotating order, so that load from other processes hits all alike (greedy, or sampled at
    ``temperature``, prompt i with seed i). Returns the runs and one row per
    tree: tau, tokens/s, steady tokens/s (rounds at their median time), median speedup over AR. After each
    prompt the log gets every tree's figures so far (what a run stopped midway still tells)."""
    measured: dict[TreeConfig, list[Run]] = {c: [] for c in trial}
    rows: list[dict] = []
    for i, prompt in enumerate(prompts):
        for cfg in rotated(trial, i):
            measured[cfg].append(tuner.decode(prompt, cfg, max_new_tokens, temperature, seed=i))
        rows = summarize_runs(measured, trial)
        so_far = ", ".join(f"{r['tree'].label} tau {r['tau']:.2f} x{r['speedup_vs_ar']:.2f}" for r in rows)
        log(f"measured prompt {i + 1}/{len(prompts)}: {so_far}")
    return measured, rows


def summarize_runs(measured: dict[TreeConfig, list["Run"]], trial: Sequence[TreeConfig]) -> list[dict]:
    """One row per tree of ``trial`` over the prompts measured so far (see ``measure_trees``)."""
    rows = []
    for cfg in trial:
        done, ar = measured[cfg], measured[AR]
        new = sum(len(r.tokens) for r in done)
        rows.append({"tree": cfg, "tau": new / sum(r.forwards for r in done),
                     "tokens_per_s": new / sum(r.elapsed_s for r in done),
                     "steady_tokens_per_s": new / sum(r.steady_s for r in done),
                     "speedup_vs_ar": statistics.median(len(r.tokens) / r.steady_s / (len(a.tokens) / a.steady_s)
                                                        for r, a in zip(done, ar))})
    return rows


def row_json(row: dict) -> dict:
    """A measured row as the presets file records it: the tree by its label, numbers to 3 decimals."""
    return {k: (v.label if k == "tree" else round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}


def summarize(rows: list[dict], runs: str, temperature: float = 0.0) -> tuple[dict, dict]:
    """The chosen row (see ``pick``) and the preset entry's common fields for measured ``rows``."""
    choice = pick(rows)
    by_tree = {r["tree"]: r for r in rows}
    fmt = row_json
    entry = {
        "tokens_per_s": round(choice["tokens_per_s"], 3),
        "steady_tokens_per_s": round(choice["steady_tokens_per_s"], 3),
        "tau": round(choice["tau"], 3),
        "speedup_vs_ar": round(choice["speedup_vs_ar"], 3),
        "ar": fmt({k: v for k, v in by_tree[AR].items() if k != "tree"}),
        "eagle2_default": fmt(by_tree[DEFAULT_TREE]),
        "validation": f"{runs}, {f'sampled at temperature {temperature:g} (prompt i with seed i)' if temperature else 'greedy'}, "
                      "every tree decoded once per prompt, back to back; steady = rounds at "
                      "their median time (spikes of load elsewhere removed); chosen: the drafting tree with the "
                      "best steady tokens/s; speedup_vs_ar: median over prompts",
        "finalists": [fmt(r) for r in rows],
    }
    if not choice["steady_tokens_per_s"] > by_tree[AR]["steady_tokens_per_s"]:
        entry["warning"] = "no drafting tree beat autoregressive decoding on this device"
    return choice, entry


def tune_shortlist(gen, prompts: Sequence[list[int]], trees: Sequence[TreeConfig], *, max_new_tokens: int = 64,
                   log: Callable[[str], None] = _log, temperature: float = 0.0) -> dict:
    """No cost model: decode each tree of ``trees`` (with AR and the EAGLE-2 default) on every prompt with
    the library's own Session (CUDA graphs, compiled rounds if ``gen.compile``) and keep the fastest.
    For GPUs, where the model's eagerly timed stage costs say little about graph-replayed rounds. With a
    ``temperature``, every decode samples (the entry of a sampling preset)."""
    start = time.perf_counter()
    tuner = Tuner(gen, log)
    trial = list(dict.fromkeys([AR, *trees, DEFAULT_TREE]))
    if gen.target.device.type == "cuda":
        # First calls capture (and compile) a round per tree and a prefill per tree and prompt-length bucket:
        # keep them out of the timings (a bucket first met while timing cost its tree ~10x its tokens/s).
        firsts = {prefill_bucket(len(p)): p for p in reversed(prompts)}
        for cfg in trial:
            for prompt in firsts.values():
                tuner.decode(list(prompt), cfg, 8, temperature)
    _, rows = measure_trees(tuner, prompts, trial, max_new_tokens, log, temperature)
    choice, entry = summarize(rows, f"{len(prompts)} prompts, {max_new_tokens} new tokens", temperature)
    entry = {"tuned": True, "method": "shortlist: every tree decoded for real, no cost model",
             "compiled_rounds": bool(getattr(gen, "compile", False)),
             **({"temperature": temperature} if temperature else {}), **entry,
             "seconds": round(time.perf_counter() - start, 1)}
    return {"tree": choice["tree"].to_dict(), "measured": entry}


def tune(gen, prompts: Sequence[list[int]], configs: Sequence[TreeConfig], *, max_new_tokens: int = 64,
         validate: int = 4, finalists: int = 3, prune_after: int = 2, keep_frac: float = 0.8, repeats: int = 3,
         warmup: int = 1, cost_prefix: Sequence[int] | None = None, log: Callable[[str], None] = _log,
         replay_table: bool = False) -> dict:
    """Measure, model and validate (module doc); returns the preset entry {"tree": ..., "measured": ...}
    ("measured" without the run's description: date, device, command; the caller adds them). With
    ``replay_table``, the entry's "replay" also holds every tree replayed to the end with its replayed tau
    ("tau_by_tree", highest first): acceptance does not depend on the device, so a CPU replay can choose the
    shortlist that a GPU then decodes for real (``--trees``)."""
    start = time.perf_counter()
    tuner = Tuner(gen, log)
    configs = list(dict.fromkeys(configs))
    prefix = list(cost_prefix) if cost_prefix is not None else [t for p in prompts for t in p][:200]
    sizes = sorted(set(COST_SIZES) | {max(c.total_tokens for c in configs), DEFAULT_TREE.total_tokens})
    target_samples: dict[int, list[float]] = {n: [] for n in sizes}
    commit_samples: dict[int, list[float]] = {2: [], 8: []}

    def sample_costs(reps: int, warm: int) -> None:  # a sweep now and then: samples see the run's load
        for n, v in tuner.target_costs(prefix, sizes, reps, warm).items():
            target_samples[n] += v
        for n, v in tuner.commit_costs(prefix, tuple(commit_samples), reps, warm).items():
            commit_samples[n] += v

    sample_costs(repeats, warmup)
    # Autoregressive references: the continuation every tree is verified against, and the AR round cost.
    refs = []
    for i, prompt in enumerate(prompts):
        refs.append(tuner.decode(prompt, AR, max_new_tokens))
        log(f"AR reference {i + 1}/{len(prompts)}: {len(refs[-1].tokens)} tokens, "
            f"{len(refs[-1].tokens) / refs[-1].elapsed_s:.2f} tok/s")
    ar_round = statistics.median([s for r in refs for s in r.round_s] or [0.0])
    step_times: dict[int, list[float]] = {}
    build_times: dict[TreeConfig, list[float]] = {}
    costs = Costs({}, {}, {})

    def refresh_costs() -> None:
        med = lambda d: {k: statistics.median(v) for k, v in d.items() if v}  # noqa: E731
        costs.target_s, costs.commit_s, costs.step_s = med(target_samples), med(commit_samples), med(step_times)
        costs.build_s = med(build_times)
        costs.rest_s = max(0.0, ar_round - costs.target_s[1])

    # Acceptance by replay; trees predicted far behind the best stop being drafted.
    runs: dict[TreeConfig, list[Replayed]] = {c: [] for c in configs}
    alive = set(configs)
    for i, (prompt, ref) in enumerate(zip(prompts, refs)):
        feats = tuner.continuation(prompt, ref.tokens)
        accepts = tuner.replay(prompt, ref.tokens, feats, sorted(alive, key=lambda c: c.label), step_times, build_times)
        for cfg, acc in accepts.items():
            runs[cfg].append(Replayed(*walk(acc, len(ref.tokens)), ref.prefill_s))
        sample_costs(1, 0)
        refresh_costs()
        pred = {c: predict(costs, c, runs[c])[1] for c in alive}
        best = max(pred, key=pred.get)
        if i + 1 >= prune_after and i + 1 < len(prompts):
            alive = prune(pred, keep_frac, finalists + 2)
        log(f"replayed {i + 1}/{len(prompts)}: best {best.label} ({pred[best]:.2f} tok/s predicted), "
            f"{len(alive)} trees still drafted")
    complete = [c for c in configs if len(runs[c]) == len(prompts)]
    table = {c: predict(costs, c, runs[c]) for c in complete}
    ranked = sorted(complete, key=lambda c: table[c][1], reverse=True)

    # Validation: real decoding of the finalists and the baselines, back to back per prompt.
    trial = list(dict.fromkeys([AR, *ranked[:finalists], DEFAULT_TREE]))
    vprompts = list(prompts[:validate])
    measured, rows = measure_trees(tuner, vprompts, trial, max_new_tokens, log)
    for cfg, row in zip(trial, rows):
        done = measured[cfg]
        replayed = runs.get(cfg, [])[: len(vprompts)]
        if len(replayed) == len(vprompts):
            row["replay_tau"], row["predicted_tokens_per_s"] = predict(costs, cfg, replayed)
        elif not cfg.drafts or cfg.top_k in costs.step_s:  # the model on this tree's measured tau
            row["predicted_tokens_per_s"] = predict(costs, cfg, [Replayed(len(r.tokens), r.forwards, r.prefill_s)
                                                                 for r in done])[1]
    choice, summary = summarize(rows, f"first {len(vprompts)} prompts, {max_new_tokens} new tokens")
    errors = [abs(r["predicted_tokens_per_s"] / r["steady_tokens_per_s"] - 1) for r in rows
              if "predicted_tokens_per_s" in r]
    entry = {
        "tuned": True,
        **summary,
        "model_error_vs_steady": {"median": round(statistics.median(errors), 3) if errors else None,
                                  "max": round(max(errors), 3) if errors else None},
        "replay": {
            "prompts": len(prompts), "max_new_tokens": max_new_tokens,
            "trees": len(configs), "kept_to_the_end": len(complete),
            "top": [{"tree": c.label, "tau": round(table[c][0], 3), "predicted_tokens_per_s": round(table[c][1], 3)}
                    for c in ranked[:12]],
            **({"tau_by_tree": {c.label: round(table[c][0], 3)
                                for c in sorted(complete, key=lambda c: table[c][0], reverse=True)}}
               if replay_table else {}),
        },
        "costs_ms": costs.to_ms(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    return {"tree": choice["tree"].to_dict(), "measured": entry}


# ---------------------------------------------------------------------------------------------- batch buckets

def smaller_trees(tree: TreeConfig, count: int = 2) -> list[TreeConfig]:
    """Up to ``count`` trees derived from ``tree``, each half the size of the one before (total_tokens halved,
    one level shallower, top_k at most the nodes below the root; the draft vocabulary kept): candidates for
    batches large enough to make the verify forward compute-bound. None below 2 tokens."""
    out, t = [], tree
    for _ in range(count):
        total = t.total_tokens // 2
        if total < 2:
            break
        t = TreeConfig(total, max(1, min(t.depth - 1, total - 1)), min(t.top_k, total - 1), t.draft_vocab)
        out.append(t)
    return out


def batch_candidates(winner: TreeConfig, extra: Sequence[TreeConfig] = (), smaller: int = 2) -> list[TreeConfig]:
    """What a batch bucket measures: autoregressive decoding, the bucket-1 winner, ``smaller`` trees halved
    from it and any ``extra`` trees, each once."""
    return list(dict.fromkeys([AR, winner, *smaller_trees(winner, smaller), *extra]))


def batch_prompt_count(batch_size: int, least: int, batches: int = 4) -> int:
    """Prompts a bucket decodes: at least ``least`` and ``batches`` batches, rounded up to whole batches.
    More prompts than rows keep continuous refill running as it does in use: with a single batch, every row
    waits for the slowest one at the end, a tail that tree decoding (rows finish at different rounds) pays
    and autoregressive decoding (every row takes the same number of steps) does not."""
    return math.ceil(max(batch_size * batches, least) / batch_size) * batch_size


def measure_batch(gen, prompts: Sequence, candidates: Sequence[TreeConfig], batch_size: int, *,
                  max_new_tokens: int = 64, repeats: int = 1, log: Callable[[str], None] = _log) -> list[dict]:
    """Decode all ``prompts`` with each candidate (AR: ``autoregressive=True``) through the public API,
    ``gen.generate(prompts, batch_size=batch_size)``, greedy, ``repeats`` passes with the candidates in
    rotating order. One row per candidate: tokens/s (new tokens of every prompt and pass / wall seconds),
    tau (new tokens / target forwards), new tokens and seconds. On CUDA each candidate first decodes the
    prompts once untimed, as the timed passes will (same token budget: every cache size and refill pattern
    is met once), and captures every prefill graph the timed passes may meet (``Session.prepare_prefills``),
    so that graph capture and compilation stay out of the timings."""

    def run(cfg: TreeConfig, new_tokens: int) -> tuple[float, list]:
        if cfg.drafts:
            gen.set_tree(cfg.total_tokens, cfg.depth, cfg.top_k, cfg.draft_vocab, cfg.pool)
        start = time.perf_counter()
        results = gen.generate(list(prompts), max_new_tokens=new_tokens, batch_size=batch_size,
                               autoregressive=not cfg.drafts)
        return time.perf_counter() - start, results

    if gen.target.device.type == "cuda":
        for cfg in candidates:
            seconds, _ = run(cfg, max_new_tokens)
            session = gen.session(autoregressive=not cfg.drafts, batch=batch_size)
            session.prepare_prefills(len(p) for p in prompts)
            log(f"batch {batch_size}: warm-up {cfg.label} {seconds:.1f} s")
    totals = {cfg: [0, 0, 0.0] for cfg in candidates}  # new tokens, target forwards, seconds
    attention = {}
    for i in range(repeats):
        for cfg in rotated(candidates, i):
            seconds, results = run(cfg, max_new_tokens)
            totals[cfg][0] += sum(r.stats.new_tokens for r in results)
            totals[cfg][1] += sum(r.stats.target_forwards for r in results)
            totals[cfg][2] += seconds
            attention[cfg] = results[-1].stats.attention if results else None
        log(f"batch {batch_size}: pass {i + 1}/{repeats}: " + ", ".join(
            f"{c.label} {totals[c][0] / totals[c][2]:.1f} tok/s" for c in candidates))
    return [{"tree": cfg, "tokens_per_s": new / seconds if seconds > 0 else 0.0, "tau": new / max(fwd, 1),
             "new_tokens": new, "seconds": seconds, "attention": attention.get(cfg)}
            for cfg, (new, fwd, seconds) in totals.items()]


#: A batch bucket drafts only when a tree beat autoregressive decoding by this factor in tuning: the tuner's
#: short answers flatter trees against long runs (H100, 2026-11-27: 1.53x / 1.14x at batch 8 / 32 in tuning,
#: 1.26x / 1.01x over 480 prompts of 256 tokens), and a tree that barely wins costs memory for nothing.
MIN_BATCH_SPEEDUP = 1.05


def fastest(rows: Sequence[dict], min_speedup: float = 1.0) -> dict:
    """The batch bucket's choice: the row with the best tokens/s, autoregressive decoding included; a
    drafting tree only if it beat autoregressive decoding (when measured) by ``min_speedup``."""
    if not rows:
        raise ValueError("no candidate was measured")
    best = max(rows, key=lambda r: r["tokens_per_s"])
    ar = next((r for r in rows if not r["tree"].drafts), None)
    if best["tree"].drafts and ar is not None and best["tokens_per_s"] < min_speedup * ar["tokens_per_s"]:
        return ar
    return best


def batch_entry(rows: Sequence[dict], batch_size: int, runs: str, min_speedup: float = MIN_BATCH_SPEEDUP) -> dict:
    """The presets entry of a batch bucket from measured rows: the fastest tree if it beat autoregressive
    decoding by ``min_speedup`` ("autoregressive" otherwise, or when decoding without a drafter won) and
    every candidate's numbers."""
    choice = fastest(rows, min_speedup)
    ar = next((r for r in rows if not r["tree"].drafts), None)
    measured = {"tuned": True, "batch_size": batch_size, "tokens_per_s": round(choice["tokens_per_s"], 3),
                "tau": round(choice["tau"], 3)}
    if ar is not None and ar["tokens_per_s"] > 0:
        measured["speedup_vs_ar"] = round(choice["tokens_per_s"] / ar["tokens_per_s"], 3)
    measured["validation"] = (f"{runs}, greedy, gen.generate(prompts, batch_size={batch_size}) per candidate, "
                              "candidates in rotating order; tokens_per_s = new tokens of all prompts / wall "
                              "time; chosen: the best tokens_per_s, autoregressive decoding included, a tree "
                              f"only if at least {min_speedup:g}x autoregressive decoding")
    measured["candidates"] = [row_json(r) for r in rows]
    tree = choice["tree"]
    return {"tree": tree.to_dict() if tree.drafts else AUTOREGRESSIVE, "measured": measured}


def tune_batch(gen, prompts: Sequence, candidates: Sequence[TreeConfig], batch_size: int, *,
               max_new_tokens: int = 64, repeats: int = 1, log: Callable[[str], None] = _log,
               min_speedup: float = MIN_BATCH_SPEEDUP) -> dict:
    """Measure the candidates for one batch bucket (``measure_batch``) and return its presets entry
    ({"tree": ..., "measured": ...}; "measured" without the run's description, which the caller adds)."""
    start = time.perf_counter()
    rows = measure_batch(gen, prompts, candidates, batch_size, max_new_tokens=max_new_tokens, repeats=repeats,
                         log=log)
    entry = batch_entry(rows, batch_size, f"{len(prompts)} prompts, {max_new_tokens} new tokens, "
                                          f"{repeats} pass(es)", min_speedup)
    entry["measured"] = {"tuned": True, "method": "batched: every candidate decoded for real through the public API",
                         "compiled_rounds": bool(getattr(gen, "compile", False)),
                         **{k: v for k, v in entry["measured"].items() if k != "tuned"},
                         "seconds": round(time.perf_counter() - start, 1)}
    return entry


def device_description(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"cpu: {name}, {os.cpu_count()} cores, {threads} torch thread(s), load average {load:.1f} at start"


def tuned_buckets(path: Path, model: str, device_type: str, command: str) -> dict[int, dict]:
    """The buckets of ``path``'s entry for a model and device type that a tuner run of ``command`` wrote
    (their measured "command"), by bucket: what --resume keeps. Empty if the file is absent."""
    path = Path(path)
    if not path.is_file():
        return {}
    entry = json.loads(path.read_text(encoding="utf-8")).get(model, {}).get(device_type, {})
    found = {int(b): e for b, e in entry.get("batch", {}).items()}
    if "tree" in entry:
        found[1] = {k: v for k, v in entry.items() if k not in ("batch", "sampling")}
    return {b: e for b, e in found.items() if e.get("measured", {}).get("command") == command}


def write_preset(path: Path, model: str, device_type: str, entry: dict, bucket: int = 1, sampling: bool = False
                 ) -> None:
    """Set the presets file's entry for a model, device type and batch bucket, keeping the rest: bucket 1
    replaces the device entry's own "tree" and "measured" (its "batch" and "sampling" objects kept), a larger
    bucket that bucket of "batch"; with ``sampling``, bucket 1's "sampling" object (the tree of calls that
    sample). The file is created if absent and replaced atomically (a temporary file in its folder, then
    os.replace): a reader, or a tuner interrupted mid-write, never leaves half a file."""
    if bucket not in BUCKETS:
        raise ConfigError(f"a batch bucket is one of {', '.join(map(str, BUCKETS))}; got {bucket!r}")
    path = Path(path)
    table = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    devices = table.setdefault(model, {})
    old = devices.get(device_type, {})
    if sampling:
        if bucket != 1:
            raise ConfigError("the tuner writes a sampling preset for single prompts (bucket 1) only")
        devices[device_type] = {**old, "sampling": entry}
    elif bucket == 1:
        devices[device_type] = {**entry, **{k: old[k] for k in ("sampling", "batch") if k in old}}
    else:
        batch = {**old.get("batch", {}), str(bucket): entry}
        devices[device_type] = {**old, "batch": dict(sorted(batch.items(), key=lambda kv: int(kv[0])))}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(table, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _trees(text: str) -> list[TreeConfig]:
    """"60/6/10,48/5/8/v16384" -> trees (total_tokens/depth/top_k[/v<draft_vocab>])."""
    try:
        return TreeConfig.parse_list(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _buckets(text: str) -> tuple[int, ...]:
    """"1,8,32" -> (1, 8, 32): batch buckets, powers of two 1 to 64, sorted and each once."""
    try:
        sizes = {int(x) for x in text.split(",")}
    except ValueError:
        sizes = set()
    if not sizes or not sizes <= set(BUCKETS):
        raise argparse.ArgumentTypeError(f"expected batch sizes among {','.join(map(str, BUCKETS))} "
                                         f"(e.g. 1,8,32), got {text!r}")
    return tuple(sorted(sizes))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trees.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--target", help="local transformers model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", help="draft head folder (default: the shipped head of the default target)")
    p.add_argument("--dtype", help="float32 / bfloat16 / float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="presets file to update (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="print the entry, do not write it")
    p.add_argument("--attention", choices=("sdpa", "flex"),
                   help="tree attention of compiled rounds (default: the library's choice per batch size, "
                        "SpeculativeGenerator.use_attention); each candidate's row records what ran")
    p.add_argument("--code", help="commit to record (default: git rev-parse --short HEAD; for a copy whose .git "
                                  "is stale)")
    p.add_argument("--prompts", type=int, default=8, help="held-out prompts (MT-bench / GSM8K test, alternating)")
    p.add_argument("--validate", type=int, default=4, help="prompts decoded for real to validate and choose")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--finalists", type=int, default=3)
    p.add_argument("--prune-after", type=int, default=2, help="prompts replayed with the whole grid")
    p.add_argument("--keep", type=float, default=0.8, help="keep drafting trees predicted >= this x the best")
    p.add_argument("--replay-table", action="store_true",
                   help="record every replayed tree's tau in the entry (with --keep 0: the whole grid), e.g. to "
                        "choose a GPU shortlist for --trees from a CPU replay")
    p.add_argument("--totals", type=_ints, default=GRID_TOTALS)
    p.add_argument("--depths", type=_ints, default=GRID_DEPTHS)
    p.add_argument("--top-ks", type=_ints, default=GRID_TOP_KS)
    p.add_argument("--repeats", type=int, default=3, help="timed cost sweeps at the start (one more per prompt)")
    p.add_argument("--trees", type=_trees, default=None, metavar="T/D/K,...",
                   help="measure only these trees (total/depth/top_k; AR and 60/6/10 are added) by real decoding "
                        "of --validate prompts, no cost model: the way to tune for a GPU")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="with --trees: decode sampling at this temperature and write the device entry's sampling "
                        "preset (the tree of calls that sample), not its greedy tree")
    p.add_argument("--compile", action="store_true", help="GPU: decode with compiled rounds (as generate(compile=True))")
    p.add_argument("--batch-sizes", type=_buckets, default=(1,), metavar="B,...",
                   help="batch buckets to tune (powers of two 1 to 64; 1: the tree for single prompts, as above; "
                        "larger: the winner, trees halved from it, --batch-trees and AR decoded in batches of B)")
    p.add_argument("--batch-trees", type=_trees, default=(), metavar="T/D/K,...",
                   help="more candidates for every bucket above 1")
    p.add_argument("--batch-repeats", type=int, default=2, help="timed passes over a bucket's prompts per candidate")
    p.add_argument("--batch-new-tokens", type=int, default=256,
                   help="new tokens per prompt in batch buckets (default 256, as the batched benchmark decodes: a "
                        "tree's lead over autoregressive decoding shrinks over long answers)")
    p.add_argument("--min-batch-speedup", type=float, default=MIN_BATCH_SPEEDUP,
                   help="a batch bucket drafts only with a tree at least this x autoregressive decoding's tokens/s")
    p.add_argument("--batch-fill", type=int, default=4,
                   help="batches of prompts a bucket decodes (prompts = this x B), so that refills run as in use")
    p.add_argument("--resume", action="store_true",
                   help="keep the buckets that --out already holds from this same command and tune the others")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the cores that the load average leaves idle, at least 1)")
    a = p.parse_args(argv)
    for flag, value in (("--batch-repeats", a.batch_repeats), ("--batch-fill", a.batch_fill),
                        ("--batch-new-tokens", a.batch_new_tokens)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(a.min_batch_speedup) and a.min_batch_speedup > 0):
        p.error(f"--min-batch-speedup must be a number > 0, got {a.min_batch_speedup}")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        p.error(f"--temperature must be a number >= 0, got {a.temperature}")
    if a.temperature > 0 and (a.trees is None or tuple(a.batch_sizes) != (1,) or a.resume):
        p.error("--temperature tunes the sampling tree of single prompts: it needs --trees, and neither "
                "--batch-sizes other than 1 nor --resume")

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = a.threads or max(1, min(cores, cores - math.ceil(load - 0.5)))
    torch.set_num_threads(threads)

    import transformers
    from transformers.utils import logging as hf_logging

    from fsd_eagle.api import SpeculativeGenerator

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gen = SpeculativeGenerator.load(target=a.target, head=a.head, device=a.device, dtype=a.dtype, tree=DEFAULT_TREE,
                                    compile=a.compile, threads=threads)
    gen.use_attention(a.attention)
    name = model_name(gen.target.model.config)
    batches = [b for b in a.batch_sizes if b > 1]
    single = (a.prompts if a.trees is None else a.validate) if 1 in a.batch_sizes else 0
    texts = held_out_prompts(max([single] + [batch_prompt_count(b, a.validate, a.batch_fill) for b in batches]))
    prompts = [gen.encode(text) for _, text in texts]
    command = "python -m trees.tune " + " ".join(x for x in (sys.argv[1:] if argv is None else argv) if x != "--resume")
    done = tuned_buckets(a.out, name, a.device, command) if a.resume else {}
    code = a.code or git_commit(short=True)

    def save(b: int, entry: dict) -> None:
        """Write bucket ``b`` at once (a later bucket's failure keeps it; --resume skips it)."""
        if a.dry_run:
            return
        write_preset(a.out, name, a.device, entry, bucket=b, sampling=a.temperature > 0)
        tree = entry["tree"] if isinstance(entry["tree"], str) else TreeConfig(**entry["tree"]).label
        where = f"/batch {b}" if b > 1 else "/sampling" if a.temperature > 0 else ""
        _log(f"wrote {name}/{a.device}{where} = {tree} to {a.out}")

    def described(entry: dict, sources: list[str], extra: dict) -> dict:
        """The entry with the run's description (date, device, versions, command, head, prompts) first."""
        m = entry["measured"]
        head_sha = head_weights_sha256(Path(a.head) if a.head else default_head_path(name))
        return {**entry, "measured": {
            "tuned": m.pop("tuned"), "date": datetime.date.today().isoformat(),
            "device": device_description(gen.target.device, threads),
            "dtype": str(gen.target.dtype).replace("torch.", ""), "torch": torch.__version__,
            "transformers": transformers.__version__, "command": command, "code": code,
            "head": str(a.head) if a.head else "shipped head", "head_sha256": head_sha,
            "prompts": sources, **extra, **m}}

    entries: dict[int, dict] = dict(done)
    if single and 1 in done:
        _log(f"{name} on {a.device}: bucket 1 kept from {a.out} (--resume)")
    elif single:
        if a.trees is not None:
            _log(f"{name} on {a.device}: {len(a.trees)} trees measured on {single} prompts")
            entry = tune_shortlist(gen, prompts[:single], a.trees, max_new_tokens=a.max_new_tokens,
                                   temperature=a.temperature)
            grid = {"trees": [t.label for t in a.trees]}
        else:
            configs = candidate_grid(a.totals, a.depths, a.top_ks)
            _log(f"{name} on {a.device} ({threads} thread(s)): {len(configs)} trees, {single} prompts")
            entry = tune(gen, prompts[:single], configs, max_new_tokens=a.max_new_tokens, validate=a.validate,
                         finalists=a.finalists, prune_after=a.prune_after, keep_frac=a.keep, repeats=a.repeats,
                         replay_table=a.replay_table)
            grid = {"grid": {"total_tokens": list(a.totals), "depth": list(a.depths), "top_k": list(a.top_ks)}}
        entries[1] = described(entry, [src for src, _ in texts[:single]], grid)
        save(1, entries[1])
    winner = TreeConfig(**entries[1]["tree"]) if single else preset_for(name, a.device, a.out)
    for b in batches:
        if b in done:
            _log(f"{name} on {a.device}, batch {b}: kept from {a.out} (--resume)")
            continue
        n = batch_prompt_count(b, a.validate, a.batch_fill)
        candidates = batch_candidates(winner, a.batch_trees)
        _log(f"{name} on {a.device}, batch {b}: {', '.join(c.label for c in candidates)} on {n} prompts")
        entry = tune_batch(gen, prompts[:n], candidates, b, max_new_tokens=a.batch_new_tokens, repeats=a.batch_repeats,
                           min_speedup=a.min_batch_speedup)
        entries[b] = described(entry, [src for src, _ in texts[:n]], {"bucket_1_tree": winner.label})
        save(b, entries[b])
    if a.temperature > 0:
        print(json.dumps({name: {a.device: {"sampling": entries[1]}}}, indent=2))
        return 0
    print(json.dumps({name: {a.device: {**entries.get(1, {}),
                                        **({"batch": {str(b): entries[b] for b in batches}} if batches else {})}}},
                     indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
