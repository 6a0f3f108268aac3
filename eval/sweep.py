"""The threshold sweep: accuracy, fidelity and speed of AR, exact EAGLE-2 and FSD over thresholds x divergences.

    python -m eval sweep --tasks gsm8k mmlu humaneval --divergences kl js --thresholds kl:0.5,1,2,4 js:0.1,0.2 \
        --limit gsm8k=200 mmlu=500 --batch-size 16 --out eval/results/sweep

Every (config, task, question) is one job: greedy decoding (temperature 0; ``--temperature`` samples instead,
every question with the run's seed) of the question's prompt (see eval/tasks.py for the prompt formats), scored
right away (GSM8K and the generated arithmetic task: final number; MMLU letter; HumanEval pass@1 in a sandboxed
subprocess), with the target's NLL of the generated tokens (eval/fidelity.py). A config is
``ar`` (plain decoding), ``eagle2`` (exact tree decoding, T = 0) or ``fsd`` at one (divergence, threshold).

Results are written per question, as they complete, to ``OUT/raw/<config>/<task>.jsonl``; a restarted sweep
with the same ``--out`` skips the questions already there (a killed run continues where it stopped). The
settings that change the outputs (target, head, dtype, tree, token limits, fuzzy mode, seed) are kept in
``OUT/settings.json`` and a run with other settings refuses to mix into the same folder.

``workers`` > 1 starts that many spawn processes, each loading the model once and taking jobs from a shared
queue (question-major order: the configs of one question run side by side, so a partial run compares every
config on the same questions). Speed figures from such a run are measured under contention of all workers on
one device: they are stored, but only a single-process speed run (eval/speed.py) gives clean numbers;
``python -m eval table --speed FILE`` merges those in.

``batch_size`` B > 1 (``--batch-size``) decodes in one process instead: the pending questions of one config
and task, in blocks of BLOCK_BATCHES x B questions (every config runs a block before the next block starts,
so a partial run still compares the configs on the same questions), go to one
``SpeculativeGenerator.generate_many(..., batch_size=B)`` call: up to B prompts share each target forward,
and each record is scored and appended as its prompt finishes. Outputs do not depend on B (each equals the
prompt decoded alone, up to floating-point differences of batch shapes in half precision; the tree is pinned,
draft vocabulary included, so a batch preset cannot change it), so B is kept in the run's metadata
(``OUT/runs.jsonl``), not in ``settings.json``: a sweep may be resumed with another B. Batching replaces worker
processes: ``workers`` > 1 with B > 1 is refused. A prompt's decoding time in a batch is no single-prompt speed:
batched records carry ``batch_size``, ``elapsed_s`` None and the per-prompt time in its batch as
``batch_elapsed_s``; the report leaves them out of tokens/s (tau, accuracy and fidelity count them all).

``shard`` (K, N) (``--shard K/N``) runs only the questions at positions K, K + N, K + 2N, ... of each task,
so that N processes (on one or several GPUs) share a sweep: each appends to files of its own,
``OUT/raw/<config>/<task>.K-of-N.jsonl``, and reads the others' without changing them; every reader (a
resume, the report) takes all of a config's files. A shard renders no report (``python -m eval table`` does,
once every shard has finished).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fsd_eagle.errors import ConfigError, FSDError, InputError

from . import tasks as _tasks
from .sweep_store import (RUNS_FILE, SETTINGS_FILE, TASKS, Config, ResultStore, format_threshold,  # noqa: F401
                          threshold_from_json, threshold_to_json)

# The tasks a sweep runs by default; always in settings.json's max_new_tokens (so older folders still resume).
DEFAULT_TASKS = ("gsm8k", "mmlu", "humaneval")
METHODS = ("ar", "eagle2", "fsd")
DEFAULT_MAX_NEW_TOKENS = {"gsm8k": 256, "mmlu": 32, "humaneval": 384, "arith": 256}
# FSD thresholds by divergence (its scale differs: KL is unbounded, JS at most ln 2); "*" for the others.
# From a first look (one GSM8K question, the shipped SmolLM2 head, CPU): KL 0.5 .. 8 made 0.01 .. 0.37 of the
# tokens fuzzy-accepted, JS 0.1 .. 0.4 0.01 .. 0.15 (JS 0.05: none). Tune them per target and head.
DEFAULT_THRESHOLDS = {"kl": (0.5, 1.0, 2.0, 4.0, 8.0), "js": (0.1, 0.2, 0.3, 0.4, 0.5),
                      "*": (0.05, 0.1, 0.2, 0.4, 0.8)}
DEFAULT_DIVERGENCES = ("kl", "js")
HUMANEVAL_TIMEOUT_S = 5.0
BLOCK_BATCHES = 8  # with --batch-size B, a task's questions run in blocks of BLOCK_BATCHES x B, every config per block
def thresholds_for(divergence: str, thresholds: Sequence[float] | dict[str, Sequence[float]]) -> list[float]:
    """The thresholds of one divergence: a plain list applies to every divergence; a dict maps divergence
    names (and "*" for the rest) to lists."""
    if isinstance(thresholds, dict):
        return list(thresholds.get(divergence, thresholds.get("*", ())))
    return list(thresholds)


def build_configs(methods: Sequence[str], divergences: Sequence[str] = DEFAULT_DIVERGENCES,
                  thresholds: Sequence[float] | dict[str, Sequence[float]] = DEFAULT_THRESHOLDS) -> list[Config]:
    """ar, eagle2 (T = 0), then fsd for each divergence x its thresholds (see :func:`thresholds_for`). An fsd
    threshold of 0 is exact EAGLE-2: it is dropped when eagle2 is also asked for."""
    from fsd_eagle.divergence import DIVERGENCES

    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"unknown method {bad[0]!r}; choose from {', '.join(METHODS)}")
    configs: list[Config] = []
    if "ar" in methods:
        configs.append(Config("ar"))
    if "eagle2" in methods:
        configs.append(Config("eagle2", None, 0.0))
    if "fsd" in methods:
        if not divergences:
            raise ConfigError("method fsd needs at least one divergence")
        for div in divergences:
            if div not in DIVERGENCES:
                raise ConfigError(f"unknown divergence {div!r}; choose from {', '.join(DIVERGENCES)}")
            values = thresholds_for(div, thresholds)
            if not values:
                raise ConfigError(f"no FSD threshold for divergence {div!r}")
            for t in values:
                if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
                    raise ConfigError(f"threshold must be a number >= 0 or inf, got {t!r}")
                if t == 0 and "eagle2" in methods:
                    continue
                c = Config("fsd", div, float(t))
                if c not in configs:
                    configs.append(c)
    if not configs:
        raise ConfigError("no configuration to run")
    return configs


# -------------------------------------------------------------------------------------------- questions


@dataclass
class Question:
    """One benchmark question: the user message, and what the scorer needs (``payload``)."""

    task: str
    qid: str
    prompt: str
    payload: dict = field(default_factory=dict)


MMLU_ORDER_SEED = 1234  # fixed, not --seed: the question set must not depend on the run's seed


def mmlu_order(total: int) -> list[int]:
    """A fixed pseudo-random order of MMLU's indices (the file is grouped by subject): its first k entries
    sample every subject, and a larger --limit keeps the questions of a smaller one (resumable)."""
    import random

    return random.Random(MMLU_ORDER_SEED).sample(range(total), total)


def load_questions(task: str, limit: int | None = None, data_dir: Path | str = _tasks.DATA_DIR) -> list[Question]:
    """The first ``limit`` GSM8K test problems or HumanEval problems; for MMLU, whose file is grouped by
    subject, the first ``limit`` of a fixed shuffled order (see :func:`mmlu_order`), kept in file order."""
    if task == "gsm8k":
        return [Question("gsm8k", str(p.index), _tasks.gsm8k_prompt(p), {"reference": p.reference})
                for p in _tasks.load_gsm8k("test", limit=limit, data_dir=data_dir)]
    if task == "mmlu":
        everything = _tasks.load_mmlu(data_dir=data_dir)
        chosen = sorted(mmlu_order(len(everything))[:limit] if limit is not None else range(len(everything)))
        return [Question("mmlu", str(q.index), _tasks.mmlu_prompt(q), {"reference": q.answer, "topic": q.topic})
                for q in (everything[i] for i in chosen)]
    if task == "arith":
        return [Question("arith", str(p.index), _tasks.arith_prompt(p), {"reference": p.reference})
                for p in _tasks.load_arith("test", limit=limit)]
    if task == "humaneval":
        return [Question("humaneval", p.task_id, _tasks.humaneval_prompt(p),
                         {"prompt": p.prompt, "test": p.test, "entry_point": p.entry_point})
                for p in _tasks.load_humaneval(limit=limit, data_dir=data_dir)]
    raise ConfigError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def score(task: str, payload: dict, text: str, humaneval_timeout_s: float = HUMANEVAL_TIMEOUT_S) -> dict:
    """{"pred", "ref", "correct"} (+ "status" for HumanEval, whose program runs in a subprocess)."""
    from .metrics import extract_gsm8k_answer, extract_mmlu_letter, humaneval_completion_code

    if task in ("gsm8k", "arith"):
        pred = extract_gsm8k_answer(text)
        return {"pred": pred, "ref": payload["reference"], "correct": pred == payload["reference"]}
    if task == "mmlu":
        pred = extract_mmlu_letter(text)
        return {"pred": pred, "ref": payload["reference"], "correct": pred == payload["reference"]}
    if task == "humaneval":
        from .humaneval_exec import check_program

        program = humaneval_completion_code(payload["prompt"], text, payload["entry_point"])
        passed, status = check_program(program, payload["test"], payload["entry_point"],
                                       timeout_s=humaneval_timeout_s)
        return {"pred": None, "ref": None, "correct": bool(passed), "status": status}
    raise ConfigError(f"unknown task {task!r}")


# ------------------------------------------------------------------------------------------ result store


_STATE: dict = {}


def _init_worker(opts: dict) -> None:
    """Load the model once per process (in a worker, or in-process when workers == 1) and warm it up."""
    import torch

    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.cli import quiet_transformers

    torch.manual_seed(opts["seed"])
    quiet_transformers()
    gen = SpeculativeGenerator.load(target=opts["target"], head=opts["head"], draft_model=opts.get("draft_model"),
                                    device=opts["device"], dtype=opts["dtype"], threads=opts.get("threads"))
    tree = opts.get("tree") or {}  # explicit --total-tokens / --depth / --tree-top-k beat the preset
    gen.set_tree(tree.get("total_tokens"), tree.get("depth"), tree.get("top_k"))
    # pin the draft vocabulary too: with every value given, batches decode on this very tree (no batch preset)
    gen.set_tree(tree.get("total_tokens"), tree.get("depth"), tree.get("top_k"), draft_vocab=gen.tree.draft_vocab)
    needs_drafter = any(c["method"] != "ar" for c in opts["configs"])
    if needs_drafter and gen.drafter is None:
        raise ConfigError("methods eagle2 and fsd need a drafter: pass --head or --draft-model "
                          "(the default model has a head)")
    if opts.get("warmup", True):  # first calls pay for kernel selection, allocation and (on GPUs) CUDA-graph
        batch = opts.get("batch_size", 1)  # capture: keep them out of the timed jobs

        def warm(**kwargs) -> None:
            gen.generate("Hello", 4, **kwargs)
            if batch > 1:  # a batch decodes on a session (and graphs) of its own
                gen.generate(["Hello"] * batch, 4, batch_size=batch, **kwargs)

        temperature, children = opts.get("temperature", 0.0), opts.get("children", "top")
        warm(autoregressive=True, temperature=temperature)
        if gen.drafter is not None:
            warm(temperature=temperature, children=children)
            if gen.target.device.type == "cuda":
                for cfg in opts["configs"]:
                    if cfg["method"] == "fsd":
                        warm(fuzzy=_fuzzy(cfg, opts), temperature=temperature, children=children)
    _STATE.clear()
    _STATE.update(gen=gen, opts=opts)


def _fuzzy(cfg: dict, opts: dict):
    from fsd_eagle.config import FuzzyConfig

    return FuzzyConfig(threshold=threshold_from_json(cfg["threshold"]), divergence=cfg["divergence"],
                       mode=opts["fuzzy_mode"])


def _decode_args(cfg: dict, opts: dict) -> dict:
    """generate / generate_many arguments of one config."""
    return {"temperature": opts.get("temperature", 0.0), "fuzzy": _fuzzy(cfg, opts) if cfg["method"] == "fsd" else None,
            "seed": opts["seed"], "autoregressive": cfg["method"] == "ar", "children": opts.get("children", "top")}


def _job_record(job: dict) -> dict:
    return {"task": job["task"], "qid": job["qid"], "config": job["key"], **job["config"]}


def _error_record(job: dict, error: Exception) -> dict:
    """A question the generator refused (e.g. a prompt longer than the model's context): scored as wrong."""
    record = _job_record(job)
    record.update(error=str(error), correct=False, token_ids=[], text="", new_tokens=0, target_forwards=0,
                  fuzzy_accepted=0, elapsed_s=0.0, nll_sum=0.0, nll_tokens=0)
    return record


def _result_record(job: dict, prompt_ids: list[int], result, batch_size: int = 1,
                   nll: tuple[float, int] | None = None) -> dict:
    """The record of one generated question: tokens, statistics, the target's NLL (``nll``: (sum, tokens)
    when already computed, see :func:`_records_of`) and the score. Decoded in a batch (``batch_size`` > 1),
    its time goes to ``batch_elapsed_s`` and ``elapsed_s`` is None."""
    from .fidelity import sequence_nll

    gen, opts = _STATE["gen"], _STATE["opts"]
    s = result.stats
    nll_sum, nll_tokens = nll or sequence_nll(gen.target.model, prompt_ids, result.token_ids)
    record = _job_record(job)
    record.update(prompt_tokens=len(prompt_ids), token_ids=result.token_ids, text=result.text,
                  stop_reason=result.stop_reason, new_tokens=s.new_tokens, target_forwards=s.target_forwards,
                  fuzzy_accepted=s.fuzzy_accepted, divergence_sum=s.divergence_sum,
                  divergence_count=s.divergence_count, elapsed_s=s.elapsed_s, nll_sum=nll_sum,
                  nll_tokens=nll_tokens)
    if batch_size > 1:
        record.update(elapsed_s=None, batch_elapsed_s=s.elapsed_s, batch_size=batch_size)
    record.update(score(job["task"], job["payload"], result.text, opts.get("humaneval_timeout_s",
                                                                         HUMANEVAL_TIMEOUT_S)))
    return record


def _run_job(job: dict) -> dict:
    """Generate, score and measure one (config, question); returns its record."""
    gen, opts = _STATE["gen"], _STATE["opts"]
    try:
        prompt_ids = gen.encode(job["prompt"])
        result = gen.generate(prompt_ids, job["max_new_tokens"], **_decode_args(job["config"], opts))
    except FSDError as e:
        return _error_record(job, e)
    return _result_record(job, prompt_ids, result)


def _run_group(jobs: list[dict], batch_size: int) -> Iterator[dict]:
    """Generate, score and measure ``jobs`` (one config and task) ``batch_size`` prompts at a time; yields
    each record as its prompt finishes. A prompt the generator refuses gets its error record and the others
    run without it (generate_many checks every prompt before decoding any)."""
    gen, opts = _STATE["gen"], _STATE["opts"]
    pending: list[tuple[dict, list[int]]] = []
    for job in jobs:
        try:
            pending.append((job, gen.encode(job["prompt"])))
        except FSDError as e:
            yield _error_record(job, e)
    while pending:
        finished: list[tuple[dict, list[int], object]] = []
        try:
            for i, result in gen.generate_many([ids for _, ids in pending], jobs[0]["max_new_tokens"],
                                               batch_size=batch_size, **_decode_args(jobs[0]["config"], opts)):
                finished.append((*pending[i], result))
                if len(finished) % batch_size == 0:
                    yield from _records_of(finished[-batch_size:], batch_size)
            yield from _records_of(finished[len(finished) - len(finished) % batch_size:], batch_size)
            return
        except InputError as e:
            refused = re.match(r"prompt (\d+): (.*)", str(e), re.S)
            if finished or refused is None or int(refused[1]) >= len(pending):
                raise
            job, _ = pending.pop(int(refused[1]))
            yield _error_record(job, InputError(refused[2]))


def _records_of(finished: list[tuple[dict, list[int], object]], batch_size: int) -> Iterator[dict]:
    """The records of questions that finished decoding, (job, prompt ids, result) each, their target NLLs
    computed together (:func:`eval.fidelity.sequences_nll`: a forward or two for a whole batch's worth of
    questions, where one forward each took longer than decoding them)."""
    from .fidelity import sequences_nll

    nlls = sequences_nll(_STATE["gen"].target.model, [(ids, result.token_ids) for _, ids, result in finished])
    for (job, ids, result), nll in zip(finished, nlls):
        yield _result_record(job, ids, result, batch_size, nll)


def group_jobs(jobs: list[dict], batch_size: int) -> list[list[dict]]:
    """Jobs (in the sweep's question-major order) as batches of one config and task, a block of
    BLOCK_BATCHES x ``batch_size`` questions at a time (``position``: the question's place in its task);
    the configs of a block come before the next block."""
    groups: dict[tuple, list[dict]] = {}
    for job in jobs:
        block = job["position"] // (BLOCK_BATCHES * batch_size)
        groups.setdefault((job["task"], block, job["key"]), []).append(job)
    return list(groups.values())


def _worker_info() -> dict:
    gen = _STATE["gen"]
    t = gen.tree
    return {"tree": t.to_dict(),
            "torch_device": str(gen.target.device), "model_dtype": str(gen.target.dtype).replace("torch.", "")}


def _pool_init(opts: dict) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        _init_worker(opts)
    except BaseException as e:  # noqa: BLE001 (a Pool restarts workers whose initializer raises, forever:
        _STATE["init_error"] = e  # keep the error and raise it from the first job, in the parent)


def _pool_job(job: dict) -> tuple[dict, dict]:
    error = _STATE.get("init_error")
    if error is not None:
        raise error
    return _run_job(job), _worker_info()


def run_jobs(jobs: list[dict], opts: dict, workers: int, on_result: Callable[[dict], None]) -> dict:
    """Run ``jobs``, calling ``on_result(record)`` in this process as each completes; returns the worker
    info (tree, device, dtype) of the model that ran them. workers == 1 runs in this process, with
    ``opts["batch_size"]`` > 1 in batches (see :func:`group_jobs`)."""
    batch_size = opts.get("batch_size", 1)
    check_parallelism(workers, batch_size)
    if workers == 1 or len(jobs) <= 1:
        _init_worker(opts)
        info = _worker_info()
        if batch_size > 1:
            records = (r for group in group_jobs(jobs, batch_size) for r in _run_group(group, batch_size))
        else:
            records = map(_run_job, jobs)
        for record in records:
            on_result(record)
        return info
    info: dict = {}
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(jobs)), initializer=_pool_init, initargs=(opts,)) as pool:
        for record, info in pool.imap_unordered(_pool_job, jobs, chunksize=1):
            on_result(record)
    return info


# ------------------------------------------------------------------------------------------------- sweep


def device_name(device: str | None) -> str:
    """A readable name of the device the sweep runs on ("NVIDIA H100 80GB HBM3", or the CPU)."""
    import torch

    from fsd_eagle.models import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def check_parallelism(workers: int, batch_size: int) -> None:
    """Worker processes or batches, not both (batching replaces the processes sharing one device)."""
    from fsd_eagle.trees_presets import BUCKETS

    if not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    if not isinstance(batch_size, int) or not 1 <= batch_size <= BUCKETS[-1]:
        raise ConfigError(f"batch size must be from 1 to {BUCKETS[-1]}, got {batch_size}")
    if workers > 1 and batch_size > 1:
        raise ConfigError(f"--workers {workers} with --batch-size {batch_size}: batching runs in one process; "
                          f"use one of them")


def run_metadata(seed: int, command: str | None, device: str | None, workers: int, batch_size: int = 1) -> dict:
    from .runinfo import git_commit, versions

    return {"device": device_name(device), **versions(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "seed": seed,
            "command": command if command is not None else " ".join(sys.argv), "workers": workers,
            "batch_size": batch_size, "git_commit": git_commit()}


def resolve_tree(target: str | None, device_type: str, tree: dict | None) -> dict:
    """The tree every job uses: explicit values over the target's preset for this device type (as
    SpeculativeGenerator.set_tree resolves it). Kept in settings.json, so a preset tuned later cannot mix
    into a resumed sweep."""
    from types import SimpleNamespace

    from fsd_eagle.models import default_target_path
    from fsd_eagle.trees_presets import TREE_KEYS as keys, model_name, preset_for, with_overrides

    tree = dict(tree or {})
    if any(tree.get(k) is None for k in keys):
        # presets are filed under the folder's name, as from_pretrained sets config._name_or_path
        folder = Path(target) if target else default_target_path()
        resolved = with_overrides(preset_for(model_name(SimpleNamespace(_name_or_path=str(folder))), device_type),
                                  *(tree.get(k) for k in keys))
        tree = {k: getattr(resolved, k) for k in keys}
    return {k: tree[k] for k in keys}


def run_sweep(out: Path | str, tasks: Sequence[str] = DEFAULT_TASKS, methods: Sequence[str] = METHODS,
              divergences: Sequence[str] = DEFAULT_DIVERGENCES,
              thresholds: Sequence[float] | dict[str, Sequence[float]] = DEFAULT_THRESHOLDS,
              *, target: str | None = None, head: str | None = None, draft_model: str | None = None,
              device: str | None = None,
              dtype: str | None = None, limit: int | dict[str, int | None] | None = None, workers: int = 1,
              max_new_tokens: dict[str, int] | None = None, seed: int = 0, fuzzy_mode: str = "hybrid",
              tree: dict | None = None, humaneval_timeout_s: float = HUMANEVAL_TIMEOUT_S,
              command: str | None = None, progress: bool = True, data_dir: Path | str = _tasks.DATA_DIR,
              report: bool = True, threads: int | None = None, batch_size: int = 1,
              temperature: float = 0.0, children: str = "top", shard: tuple[int, int] | None = None) -> dict:
    """Run (or continue) a sweep into ``out``; returns the results dict also written to OUT/results.json.

    ``batch_size`` > 1 decodes up to that many questions of one config and task together (one process; see
    the module docstring). It does not change the outputs and is no part of ``settings.json``.

    ``threads``: torch CPU threads per worker (default: SpeculativeGenerator.load's with one in-process worker;
    otherwise the CPU cores shared among the workers on CPU, 1 per worker on GPU).

    ``temperature`` > 0 samples (every question with ``seed``; lossless for eagle2) instead of decoding
    greedily; it is kept in settings.json (only when not 0, so older greedy folders still resume), and so is
    ``children`` "sampled" (draft tokens drawn from the drafter at the temperature; "top": its most likely).

    ``shard`` (K, N): only questions K, K + N, ... of each task, into files of this shard's own, and no
    report (see the module docstring)."""
    from fsd_eagle.models import resolve_device, resolve_dtype

    check_parallelism(workers, batch_size)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
        raise ConfigError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if children not in ("top", "sampled"):
        raise ConfigError(f"children must be 'top' or 'sampled', got {children!r}")
    if children == "sampled" and not temperature:
        raise ConfigError("sampled children need a temperature > 0 (greedy decoding drafts the top tokens)")
    if shard is not None:
        k, n = shard
        if not (isinstance(k, int) and isinstance(n, int) and n >= 1 and 0 <= k < n):
            raise ConfigError(f"shard must be K/N with 0 <= K < N, got {k}/{n}")
        report = False
    configs = build_configs(methods, divergences, thresholds)
    tasks = list(dict.fromkeys(tasks))
    for t in tasks:
        if t not in TASKS:
            raise ConfigError(f"unknown task {t!r}; choose from {', '.join(TASKS)}")
    limit_of = dict(limit) if isinstance(limit, dict) else {t: limit for t in TASKS}
    for t, n in limit_of.items():
        if n is not None and (not isinstance(n, int) or n < 0):
            raise InputError(f"--limit must be an integer >= 0, got {n!r} for {t}")
    limits = dict(DEFAULT_MAX_NEW_TOKENS, **(max_new_tokens or {}))
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    out = Path(out)
    store = ResultStore(out, shard)
    settings = {"target": str(target) if target else "default", "head": str(head) if head else "default",
                **({"draft_model": str(draft_model)} if draft_model else {}),
                "dtype": str(dt).replace("torch.", ""), "tree": resolve_tree(target, dev.type, tree),
                "fuzzy_mode": fuzzy_mode,
                "max_new_tokens": {t: limits[t] for t in TASKS if t in DEFAULT_TASKS or t in tasks}, "seed": seed,
                **({"temperature": float(temperature)} if temperature else {}),
                **({"children": children} if children != "top" else {})}
    store.check_settings(settings)

    questions = {t: load_questions(t, limit_of.get(t), data_dir) for t in tasks}
    done = {(c.key, t): store.done(c.key, t) for c in configs for t in tasks}
    jobs, total = [], 0
    for t in tasks:
        for position, q in enumerate(questions[t]):
            if shard is not None and position % shard[1] != shard[0]:
                continue
            for c in configs:
                total += 1
                if q.qid in done[(c.key, t)]:
                    continue
                jobs.append({"config": c.to_json(), "key": c.key, "task": t, "qid": q.qid, "prompt": q.prompt,
                             "payload": q.payload, "max_new_tokens": limits[t],
                             "position": position if shard is None else position // shard[1]})
    cpu = os.cpu_count() or 1
    opts = {"target": str(target) if target else None, "head": str(head) if head else None,
            "draft_model": str(draft_model) if draft_model else None, "device": device,
            "dtype": dtype, "seed": seed, "fuzzy_mode": fuzzy_mode, "tree": settings["tree"],
            "configs": [c.to_json() for c in configs], "humaneval_timeout_s": humaneval_timeout_s,
            "batch_size": batch_size, "temperature": float(temperature), "children": children,
            "threads": threads if threads else (None if workers == 1 else
                                                 max(1, cpu // workers) if dev.type == "cpu" else 1)}
    meta = run_metadata(seed, command, device, workers, batch_size)
    meta.update(settings=settings, tasks=tasks, limit={t: limit_of.get(t) for t in tasks},
                configs=[c.key for c in configs], threads=opts["threads"], jobs_total=total,
                jobs_skipped=total - len(jobs), **({"shard": f"{shard[0]}/{shard[1]}"} if shard else {}))
    if "humaneval" in tasks:  # what contained the candidate programs on this machine
        from .humaneval_exec import protections
        meta["humaneval_sandbox"] = protections()
    print(f"sweep: {len(configs)} configs x {sum(len(q) for q in questions.values())} questions = {total} jobs; "
          f"{total - len(jobs)} already in {out}, {len(jobs)} to run on {meta['device']} with "
          + (f"batches of up to {batch_size}" if batch_size > 1 else f"{workers} worker(s)"),
          file=sys.stderr)
    start, finished, ran = time.perf_counter(), False, 0
    try:
        if jobs:
            if target is None:  # convert the default model once here, not in every worker at the same time
                from fsd_eagle.models import default_target_path

                default_target_path()
            bar = _progress(total, total - len(jobs), progress)

            def on_result(record: dict) -> None:
                nonlocal ran
                store.append(record)
                ran += 1
                bar.update(1)
                bar.set_postfix_str(f"{record['config']} {record['task']}", refresh=False)

            try:
                meta.update(run_jobs(jobs, opts, workers, on_result))
            finally:
                bar.close()
                store.close()
        finished = True
    finally:  # also for a failed or interrupted run: its command and device stay on record
        meta.update(wall_s=round(time.perf_counter() - start, 1), jobs_run=ran, finished=finished)
        with open(out / RUNS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(meta) + "\n")
    if not report:
        return {"meta": meta}
    from .report import build_results, write_outputs

    results = build_results(out)
    write_outputs(out, results)
    return results


def _progress(total: int, initial: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but a bar is not worth failing for
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n=1): ...
            def set_postfix_str(self, s, refresh=True): ...
            def close(self): ...
        return _Null()
    return tqdm(total=total, initial=initial, unit="job", dynamic_ncols=True, smoothing=0.05)


def _parse_task_ints(items: Iterable[str] | None, flag: str, minimum: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep:
            name, value = "", item
        try:
            n = int(value)
        except ValueError:
            raise ConfigError(f"{flag} takes N or TASK=N, got {item!r}") from None
        if n < minimum:
            raise ConfigError(f"{flag} must be >= {minimum}, got {item!r}")
        if name and name not in TASKS:
            raise ConfigError(f"unknown task {name!r} in {flag}; choose from {', '.join(TASKS)}")
        for t in ([name] if name else TASKS):
            out[t] = n
    return out


def parse_max_new_tokens(items: Iterable[str] | None) -> dict[str, int]:
    """``["256"]`` (every task) or ``["gsm8k=256", "mmlu=16"]`` -> {task: n}; later items win."""
    return _parse_task_ints(items, "--max-new-tokens", 1)


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """``--shard K/N`` as (K, N), 0 <= K < N; None for no shard."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if m is None or not int(m[1]) < int(m[2]):
        raise InputError(f"--shard must be K/N with 0 <= K < N, got {text!r}")
    return int(m[1]), int(m[2])


def parse_limits(items: Iterable[str] | None) -> dict[str, int]:
    """``--limit``: ``["200"]`` (every task) or ``["gsm8k=200", "mmlu=500"]`` -> {task: n}; a task not
    named runs all its questions."""
    return _parse_task_ints(items, "--limit", 0)


def parse_thresholds(items: Iterable[str] | None) -> dict[str, list[float]]:
    """``--thresholds``: numbers (``0.1 0.5 inf``, for every divergence) and/or per-divergence lists
    (``kl:0.5,1,2 js:0.1,0.2``) -> {divergence or "*": [T, ...]}; missing entries fall back to
    DEFAULT_THRESHOLDS."""
    from fsd_eagle.config import parse_threshold

    def parse(text: str) -> float:
        value = parse_threshold(text)
        if value < 0:
            raise ConfigError(f"threshold must be a number >= 0 or inf, got {text!r}")
        return value

    out: dict[str, list[float]] = {}
    common: list[float] = []
    for item in items or ():
        name, sep, values = item.partition(":")
        if sep:
            if not name or not values:
                raise ConfigError(f"--thresholds takes T or DIVERGENCE:T1,T2,..., got {item!r}")
            out.setdefault(name, []).extend(parse(v) for v in values.split(",") if v.strip())
        else:
            common.append(parse(item))
    defaults = {k: list(v) for k, v in DEFAULT_THRESHOLDS.items()}
    if common:
        defaults = {"*": common}
    return {**defaults, **out}
