"""``python -m eval <command>`` (also ``fsd-eagle bench <command>``) from a source checkout.

    sweep  accuracy, fidelity and speed of AR, exact EAGLE-2 and FSD over thresholds x divergences
           (resumable; see eval/sweep.py)
    tau    acceptance length per category on MT-bench / Spec-Bench (eval/tau.py)
    replay tau of several trees replayed on the target's own answers, greedy or sampled (eval/replay_tau.py):
           every tree on the same texts
    table  re-render results.json / results.md / accuracy_vs_speed.png of a sweep folder, optionally merging
           a single-process speed run (eval/report.py)
    speed  single-process GPU speed benchmark (eval/speed.py; its own options, see `speed --help`)
    batch  batched throughput over batch sizes, ours and transformers generate (eval/batch.py; resumable;
           its own options, see `batch --help`)
    serve  serving benchmark over HTTP: fsd-eagle serve with and without speculation, optionally transformers
           serve, closed-loop concurrency levels and a Poisson rate (eval/serve.py; see `serve --help`)
    figures  the README's figures (docs/figures/*.svg) from committed results (eval/figures.py)
    head-scaling  the draft head's scaling study: add a trained head's point, show points and the stop rule's
           verdicts (eval/head_scaling.py)
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import signal
import sys
from pathlib import Path

from fsd_eagle.config import SamplingConfig, TreeConfig
from fsd_eagle.errors import ConfigError, FSDError, exit_out_of_memory
from fsd_eagle.jsonl import write_text_atomic


def _model_args(p: argparse.ArgumentParser, several: bool = True) -> None:
    """The model options; ``several``: also --draft-model and --workers (commands that decode with either
    drafter in several processes)."""
    p.add_argument("--target", help="local transformers model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", help="draft head folder (default: the head shipped for the target, if any)")
    if several:
        p.add_argument("--draft-model", help="a small causal LM folder sharing the target's tokenizer, drafting "
                                             "instead of a head (classic SD; a chain suits it: tree top-k 1, e.g. depth 5)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bf16 on GPU, fp32 on CPU)")
    if several:
        p.add_argument("--workers", type=int, default=1,
                       help="processes sharing the device, each loading the model once (1 = this process)")


def _parser() -> argparse.ArgumentParser:
    from .sweep import DEFAULT_DIVERGENCES, DEFAULT_MAX_NEW_TOKENS, DEFAULT_TASKS, DEFAULT_THRESHOLDS, METHODS, TASKS

    from fsd_eagle.cli import OneLineParser

    parser = OneLineParser(prog=_prog(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("sweep", help="accuracy / fidelity / speed over thresholds x divergences (resumable)")
    _model_args(p)
    p.add_argument("--out", required=True, help="results folder (rerun with the same folder to resume)")
    p.add_argument("--limit", nargs="+", metavar="[TASK=]N", dest="limits",
                   help="questions per task: N for every task, or per task (gsm8k=200 mmlu=500); default all")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--thresholds", nargs="+", metavar="T|DIV:T1,T2",
                   help="FSD thresholds (numbers >= 0 or inf) for every divergence, and/or per divergence "
                        "(kl:0.5,1,2 js:0.1,0.2); exact EAGLE-2 is method eagle2; default "
                        + " ".join(f"{d}:{','.join(format(t, 'g') for t in ts)}"
                                   for d, ts in DEFAULT_THRESHOLDS.items()))
    p.add_argument("--divergences", nargs="+", default=list(DEFAULT_DIVERGENCES))
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=TASKS,
                   help="default: " + " ".join(DEFAULT_TASKS) + " (arith: the generated arithmetic test problems)")
    p.add_argument("--max-new-tokens", nargs="+", metavar="[TASK=]N",
                   help="token limit, for every task (N) or per task (gsm8k=256); default "
                        + ", ".join(f"{t}={n}" for t, n in DEFAULT_MAX_NEW_TOKENS.items()))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples every question with --seed (EAGLE-2 stays lossless)")
    p.add_argument("--children", default="top", choices=("top", "sampled"),
                   help="with --temperature: draft each node's most likely tokens (top, default) or draw them "
                        "from the drafter at the temperature (sampled: speculative sampling)")
    p.add_argument("--shard", metavar="K/N",
                   help="only questions K, K+N, K+2N, ... of each task (N processes share one --out; each "
                        "writes its own files; render with `table` once all have finished)")
    p.add_argument("--fuzzy-mode", default="hybrid", choices=("hybrid", "pure"))
    p.add_argument("--total-tokens", type=int, help="tree nodes per round (default: the target's preset)")
    p.add_argument("--depth", type=int, help="tree depth (default: the target's preset)")
    p.add_argument("--tree-top-k", type=int, help="children per expanded node (default: the target's preset)")
    p.add_argument("--threads", type=int, help="torch CPU threads per worker (default: CPU cores / workers on "
                                               "CPU, 1 on GPU; for one worker, fsd-eagle generate's default: "
                                               "cores - 1, at most 4); 1 helps on a busy CPU")
    p.add_argument("--batch-size", type=int, default=1,
                   help="questions of one config and task decoded together in this process (default 1: one "
                        "at a time; outputs do not depend on it; not with --workers > 1)")
    p.add_argument("--humaneval-timeout", type=float, default=5.0, help="seconds per HumanEval test run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser("tau", help="acceptance length tau per category (MT-bench or Spec-Bench)")
    _model_args(p)
    p.add_argument("--questions", choices=("mt_bench", "spec_bench"), default="mt_bench")
    p.add_argument("--limit", type=int, help="questions (default: all)")
    p.add_argument("--per-category", type=int, metavar="N",
                   help="only the first N questions of each category (a stratified subset; after --limit)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (question i with seed --seed + i); default 0: greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree", metavar="T/D/K[/vV]",
                   help="draft tree, e.g. 64/6/8/v16384 (default: fsd_eagle.config.TreeConfig's defaults)")
    p.add_argument("--exact", action="store_true",
                   help="also decode each question autoregressively and count identical answers (greedy only)")
    p.add_argument("--out", help="also write the JSON to OUT/tau.json")

    p = sub.add_parser("replay", help="tau of trees replayed on the target's own answers (eval/replay_tau.py)")
    _model_args(p, several=False)
    p.add_argument("--trees", required=True, metavar="T/D/K[/vV],...", help="comma-separated draft trees")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="answers sampled at this temperature (question i with seed --seed + i); default 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--questions", choices=("mt_bench", "spec_bench"), default="mt_bench")
    p.add_argument("--limit", type=int, help="questions (default: all)")
    p.add_argument("--per-category", type=int, metavar="N", help="only the first N questions of each category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="question i's answer is sampled with seed + i")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", help="also write the JSON to OUT/replay_tau.json")

    sub.add_parser("speed", help="single-process GPU speed benchmark (eval/speed.py)", add_help=False)
    sub.add_parser("batch", help="batched throughput over batch sizes (eval/batch.py)", add_help=False)
    sub.add_parser("serve", help="serving benchmark: our server with and without speculation, transformers "
                                 "serve (eval/serve.py)", add_help=False)
    sub.add_parser("figures", help="the README's figures from committed results (eval/figures.py)", add_help=False)
    sub.add_parser("head-scaling", help="the draft head's scaling study (eval/head_scaling.py)", add_help=False)

    p = sub.add_parser("table", help="render results.json, results.md and the plot of a sweep folder")
    p.add_argument("--out", required=True, help="the sweep's results folder")
    p.add_argument("--speed", help="JSON of a single-process speed run to merge (default: OUT/speed.json if any)")
    p.add_argument("--no-plot", action="store_true")
    return parser


def _prog() -> str:
    return "fsd-eagle bench" if sys.argv and sys.argv[0].startswith("fsd-eagle") else "python -m eval"


def _command_line(argv: list[str]) -> str:
    return " ".join([_prog()] + [shlex.quote(a) for a in argv])


def run_sweep_command(a: argparse.Namespace, argv: list[str]) -> int:
    from .sweep import parse_limits, parse_max_new_tokens, parse_shard, parse_thresholds, run_sweep

    tree = {k: v for k, v in (("total_tokens", a.total_tokens), ("depth", a.depth), ("top_k", a.tree_top_k))
            if v is not None}
    run_sweep(a.out, a.tasks, a.methods, a.divergences, parse_thresholds(a.thresholds), target=a.target,
              head=a.head, draft_model=getattr(a, "draft_model", None), device=a.device, dtype=a.dtype,
              limit=parse_limits(a.limits), workers=a.workers,
              max_new_tokens=parse_max_new_tokens(a.max_new_tokens), seed=a.seed, fuzzy_mode=a.fuzzy_mode,
              tree=tree or None, humaneval_timeout_s=a.humaneval_timeout, command=_command_line(argv),
              progress=not a.no_progress, threads=a.threads, batch_size=a.batch_size,
              temperature=a.temperature, children=a.children, shard=parse_shard(a.shard))
    if a.shard:
        print(f"shard {a.shard} finished; render the sweep with: {_prog()} table --out {shlex.quote(a.out)}")
    else:
        print((Path(a.out) / "results.md").read_text())
    return 0


def _questions(a: argparse.Namespace) -> list:
    """The questions that --questions, --limit and --per-category choose."""
    from .tasks import first_per_category, load_mt_bench, load_spec_bench

    questions = (load_mt_bench if a.questions == "mt_bench" else load_spec_bench)(limit=a.limit)
    return questions if a.per_category is None else first_per_category(questions, a.per_category)


def run_tau_command(a: argparse.Namespace, argv: list[str]) -> int:
    from fsd_eagle.models import resolve_device

    from .speed import device_label
    from .tau import measure_tau

    questions = _questions(a)
    try:  # a temperature or tree that generate would refuse, refused before any model loads
        SamplingConfig(temperature=a.temperature)
    except ConfigError as e:
        raise ConfigError(f"--{e}") from None
    try:
        tree = TreeConfig.parse(a.tree) if a.tree else TreeConfig()
    except ConfigError as e:
        raise ConfigError(f"--tree: {e}") from None
    if a.head is not None and a.draft_model is not None:
        raise ConfigError("use either --head or --draft-model, not both")
    if a.exact and a.temperature:
        raise ConfigError("--exact compares greedy decoding with autoregressive decoding: use it at temperature 0")
    result = measure_tau(questions, a.target, a.head, a.device, a.dtype, a.max_new_tokens, a.workers,
                         tree=tree.to_dict(), temperature=a.temperature, seed=a.seed, draft_model=a.draft_model,
                         exact=a.exact)
    return _report(result, a.out, "tau.json", argv, device=device_label(resolve_device(a.device)))


def _report(result: dict, out: str | None, name: str, argv: list[str], **run) -> int:
    """Record the run (date, ``run``'s fields, command, code, versions) in ``result``, write it to OUT/name
    (atomically) when asked, print it as one JSON line."""
    from .runinfo import git_commit, versions

    result["run"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **run,
                     "command": _command_line(argv), "code": git_commit(short=True), **versions()}
    text = json.dumps(result)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        write_text_atomic(Path(out) / name, text + "\n")
    print(text)
    return 0


def run_replay_command(a: argparse.Namespace, argv: list[str]) -> int:
    from fsd_eagle.api import SpeculativeGenerator

    from .replay_tau import replay_answers
    from .speed import device_label

    try:
        SamplingConfig(temperature=a.temperature, top_p=a.top_p)
    except ConfigError as e:
        raise ConfigError(f"--{e}") from None
    try:
        trees = TreeConfig.parse_list(a.trees)
    except ConfigError as e:
        raise ConfigError(f"--trees: {e}") from None
    if not trees or any(not t.drafts for t in trees):
        raise ConfigError(f"--trees needs drafting trees (total/depth/top_k), got {a.trees!r}")
    pooled = [t.label for t in trees if t.pool]
    if pooled and a.temperature:
        raise ConfigError(f"--trees: {', '.join(pooled)} sample their children from a pool, which a replay "
                          "cannot follow (it replays top children); decode them instead (python -m eval speed)")
    questions = _questions(a)
    gen = SpeculativeGenerator.load(target=a.target, head=a.head, device=a.device, dtype=a.dtype, threads=a.threads)
    if gen.drafter is None:
        raise ConfigError("this target has no draft head: pass --head")
    result = replay_answers(gen, questions, trees, a.temperature, a.top_p, a.seed, a.max_new_tokens)
    return _report(result, a.out, "replay_tau.json", argv, device=device_label(gen.target.device),
                   dtype=str(gen.target.dtype).replace("torch.", ""), head=a.head or "shipped")


def run_table_command(a: argparse.Namespace, argv: list[str]) -> int:
    from .report import build_results, write_outputs

    results = build_results(a.out, a.speed)
    for path in write_outputs(a.out, results, plot=not a.no_plot):
        print(f"wrote {path}", file=sys.stderr)
    print((Path(a.out) / "results.md").read_text())
    return 0


def _out_of_memory(error: RuntimeError) -> int:
    """One line and fsd_eagle.errors.OUT_OF_MEMORY_STATUS for a device out of memory; any other error goes on up."""
    return exit_out_of_memory(error, "use a smaller --batch-size or fewer processes on this device, then rerun "
                                     "the same command (sweeps and batch runs continue where they stopped)")


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run a command; a Ctrl-C at any moment (also while torch loads) ends with one line and status 130."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] == "speed":  # eval/speed.py parses its own options
            from .speed import main as speed_main

            return speed_main(argv[1:])
        if argv and argv[0] == "batch":  # so does eval/batch.py
            from .batch import main as batch_main

            return batch_main(argv[1:])
        if argv and argv[0] == "serve":  # and eval/serve.py
            from .serve import main as serve_main

            return serve_main(argv[1:])
        if argv and argv[0] == "figures":  # and eval/figures.py
            from .figures import main as figures_main

            return figures_main(argv[1:])
        if argv and argv[0] == "head-scaling":  # and eval/head_scaling.py
            from .head_scaling import main as head_scaling_main

            return head_scaling_main(argv[1:])
        args = _parser().parse_args(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, MemoryError) as e:
        return _out_of_memory(e)
    if getattr(args, "workers", 1) < 1:
        print("error: --workers must be at least 1", file=sys.stderr)
        return 2
    previous = None
    if args.command == "sweep":  # `timeout` / a scheduler's SIGTERM: stop the workers, keep what is done
        try:
            previous = signal.signal(signal.SIGTERM, _interrupt)
        except ValueError:  # not the main thread
            pass
    try:
        from fsd_eagle.cli import quiet_transformers

        quiet_transformers()
        return {"sweep": run_sweep_command, "tau": run_tau_command, "replay": run_replay_command,
                "table": run_table_command}[args.command](args, argv)
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command to continue", file=sys.stderr)
        return 130
    except (RuntimeError, MemoryError) as e:
        return _out_of_memory(e)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    from fsd_eagle.cli import exit_with

    exit_with(main())
