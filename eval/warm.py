"""Compile a speed run's configurations side by side before it measures them (``python -m eval speed --warm N``).

A compiled configuration (one rule form: AR, exact or a divergence, greedy or sampling, top or sampled
children, per tree) takes a minute or more to compile, mostly on the CPU and one after the other within a
process. Its compiled code depends only on the configuration, not on what the process compiled before, so
short processes that each decode two prompts with one configuration fill the machine's inductor cache, N at a
time, and the measuring process then finds every compilation there. (On an H200 host, 2026-11-28: eleven such
processes, AR, EAGLE-2 and two FSD rules at T = 0 and 0.7 with top and sampled children, on 32 cores, took
222 s together.) Graph rounds need no warming: their capture is per process and takes seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Options of `eval speed` that decide what a configuration compiles (the rest are per-row or per-run).
SHAPE_OPTIONS = ("target", "head", "draft_model", "device", "dtype", "threads", "prompts", "top_p", "seed",
                 "total_tokens", "depth", "tree_top_k", "draft_vocab", "pool", "trees")


@dataclass(frozen=True)
class Warmup:
    """One configuration to compile: a name for its files, and its `eval speed` options."""

    name: str
    options: tuple[str, ...]


def warmups(a, methods: list[str], fsd_rows: list[tuple[str, float]], temperatures: list[float],
            children: list[str]) -> list[Warmup]:
    """One short compiled `eval speed` run per row configuration of the parsed options ``a``: each method
    (hf needs no compilation), each FSD divergence:threshold, each temperature and, when sampling, each kind of
    children, and for drafting methods each of several ``--trees`` (the same rows the full run measures, in the
    same order, less those that ``--rows`` leaves out). FSD rows of one divergence share their compiled code
    (the threshold is a number the round reads), so its first threshold stands for all. Each tree gets a run of
    its own because a process compiles one configuration after the other: six trees in one warm-up took about
    15 minutes on an H200 host, where side by side they take about what one does."""
    from eval.rows import parse_trees, row_patterns, row_wanted, sampling_rows

    patterns = row_patterns(getattr(a, "rows", ""))
    trees = [t.label for t in parse_trees(getattr(a, "trees", None))]
    common: list[str] = []
    for key in SHAPE_OPTIONS:
        value = getattr(a, key, None)
        if value is not None and key != "trees":
            common += [f"--{key.replace('_', '-')}", str(value)]
    if getattr(a, "inductor_freezing", False):
        common.append("--inductor-freezing")
    common += ["--backends", "compiled", "--limit", "2", "--max-new-tokens", "16", "--repeats", "1", "--rows-only"]
    common += ["--rows", a.rows] if patterns else []
    out = []
    for method in (m for m in methods if m in ("ar", "eagle2", "fsd")):
        first: dict[str, float] = {}  # each divergence's first threshold
        for d, t in fsd_rows:
            first.setdefault(d, t)
        rules = ([(d, f"{d}{t:g}", ["--fsd", f"{d}:{t:g}"]) for d, t in first.items()] if method == "fsd"
                 else [(None, "", [])])
        for divergence, rule_name, rule_options in rules:
            # the rows this compilation serves: every threshold of its divergence (one for other methods)
            thresholds = [t for d, t in fsd_rows if d == divergence] if method == "fsd" else [None]
            for t, kind in sampling_rows(method, temperatures, children):
                # plain decoding's rows do not depend on the tree: one run for all
                for tree in [None] if method == "ar" or len(trees) < 2 else trees:
                    its_trees = trees if tree is None else [tree]
                    rows = [{"method": method, "divergence": divergence, "threshold": threshold,
                             "backend": "compiled", "temperature": t, "top_p": a.top_p if t else 1.0,
                             "children": kind, "tree": "ar" if method == "ar" else each}
                            for threshold in thresholds for each in its_trees or [None]]
                    if not any(row_wanted(patterns, row, with_tree=bool(trees)) for row in rows):
                        continue
                    name = (f"{method}{rule_name}" + (f"_{tree.replace('/', '-')}" if tree else "") + f"_t{t:g}"
                            + ("_sampled" if kind == "sampled" else ""))
                    tree_options = ["--trees", ",".join(its_trees)] if its_trees else []
                    out.append(Warmup(name, tuple(common + tree_options + [
                        "--methods", method, *rule_options, "--temperatures", f"{t:g}", "--children", kind])))
    return out


def run_side_by_side(commands: list[tuple[str, list[str]]], at_once: int, log_dir: Path,
                     env: dict[str, str] | None = None) -> dict[str, int]:
    """Run the named commands (argv lists), ``at_once`` at a time, from the repository root, each logging to
    ``log_dir/NAME.log``; one line per command as it ends. Returns each one's exit status."""
    log_dir.mkdir(parents=True, exist_ok=True)
    waiting, running, status = list(commands), {}, {}
    while waiting or running:
        while waiting and len(running) < at_once:
            name, argv = waiting.pop(0)
            with open(log_dir / f"{name}.log", "w") as log:
                running[name] = (subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env),
                                 time.perf_counter())
        for name, (proc, started) in list(running.items()):
            if proc.poll() is not None:
                status[name] = proc.returncode
                del running[name]
                what = "done" if proc.returncode == 0 else f"failed (status {proc.returncode}; {log_dir / name}.log)"
                print(f"warm-up {name}: {what} in {time.perf_counter() - started:.0f} s", flush=True)
        time.sleep(0.2)
    return status


def warm(jobs: list[Warmup], at_once: int, out: Path) -> dict[str, int]:
    """Compile ``jobs`` ``at_once`` at a time (files under ``out``: each run's rows and log); each process gets
    an equal share of the CPU cores for inductor's compile workers. A failed warm-up is reported and left to
    the measuring run, which compiles what it does not find."""
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, (os.cpu_count() or 1) // max(1, at_once))))
    commands = [(j.name, [sys.executable, "-m", "eval", "speed", *j.options, "--out", str(out / f"{j.name}.json")])
                for j in jobs]
    return run_side_by_side(commands, at_once, out, env)
