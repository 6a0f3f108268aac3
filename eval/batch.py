"""Batched throughput: tokens per second of a whole prompt set decoded ``batch_size`` prompts at a time, for our
plain AR, exact EAGLE-2, FSD and transformers ``generate``, at each batch size, in one process.

    python -m eval batch --device cuda --dtype bfloat16 --compile --hf-limit 16      # the full benchmark
    python -m eval batch --batch-sizes 1,8 --methods ar,eagle2 --limit 40 --max-new-tokens 64   # a short run
    python -m eval batch ... --resume          # after a kill: keeps the finished rows, measures the rest

Prompts: MT-bench's 80 first turns, then Spec-Bench's other questions in file order (its copy of MT-bench
skipped), up to ``--limit`` (480: all of them); chat-templated. Our methods decode the whole set with one
``SpeculativeGenerator.generate(prompts, batch_size=B, ...)`` call; transformers ``generate`` decodes it in
batches of B left-padded prompts, on the first ``max(B, --hf-limit)`` prompts only when ``--hf-limit`` is given
(it is far slower at small batches).

Rows: ``method`` (ar, eagle2, fsd, hf_generate), ``divergence`` / ``threshold`` (FSD), ``batch_size``,
``tokens_per_s`` (new tokens of all prompts / wall time of the whole set), ``tau`` (new tokens / target forwards,
summed over prompts; None for transformers), ``peak_mem_gb`` (``torch.cuda.max_memory_allocated`` over the
timed run, everything the process holds included; None on the CPU), ``prompts``, ``max_new_tokens``,
``device``, ``dtype``, ``tree`` (the generator's tree after the call; None for transformers), ``vs_ar``
(tokens_per_s over the AR row of the same batch size in the same file), and ``new_tokens``, ``wall_s``,
``temperature``, ``compile``, ``mode`` / ``attention`` (how the rounds ran), and where the wall time went
(``time_split``: device seconds in prefills and in rounds, their counts, ms per round, the rest). At batch
size 1 our rows also give ``mt_bench_prompts``, ``mt_bench_tokens_per_s`` and ``mt_bench_tau``: those of
MT-bench's first turns alone (the speed benchmark's set; None elsewhere). New tokens are counted as
``DecodeStats.new_tokens`` counts them: the tokens before the first EOS, plus the EOS when one ended the text.

The file (default ``eval/results/gpu_batch.json`` on a GPU, ``cpu_batch.json`` on the CPU) is rewritten
atomically after every row, so a killed run leaves a valid file with the rows it finished. Its ``meta`` holds
the date, command line, commit, library versions and the settings that change the figures; ``--resume``
keeps the rows of a file with the same settings and skips their (method, divergence, threshold, batch size).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import time
from pathlib import Path

import torch

from fsd_eagle.decode import freezing
from fsd_eagle.errors import ConfigError, InputError

from .runinfo import git_commit, versions, write_json_atomic
from .speed import add_tree_arguments, device_label, parse_fsd, sync
from .sweep import format_threshold, threshold_to_json
from .tasks import load_mt_bench

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ar", "eagle2", "fsd", "hf")
DEFAULT_BATCH_SIZES = "1,4,8,16,32,64"
ROW_NAMES = {"ar": "ar", "eagle2": "eagle2", "fsd": "fsd", "hf": "hf_generate"}


# ------------------------------------------------------------------------------------------------ prompts


def load_prompts(limit: int | None = None) -> list[str]:
    """First turns of ``eval.tasks.load_chat_benchmark``: MT-bench, then the rest of Spec-Bench."""
    from .tasks import load_chat_benchmark

    return [q.turns[0] for q in load_chat_benchmark(limit)]


# ---------------------------------------------------------------------------------- transformers generate


def left_pad(batch: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` ``[len(batch), longest]``: each prompt right-aligned after pads
    (left padding, as transformers ``generate`` needs for decoder-only models)."""
    width = max(len(ids) for ids in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def split_new_tokens(generated: torch.Tensor, eos_ids) -> list[tuple[list[int], int]]:
    """Per row of ``generated`` (the new tokens of a batch, ``[B, T]``): the ids before the first EOS, and the
    count of new tokens as ``DecodeStats.new_tokens`` has it (those ids, plus 1 when an EOS ended the row).
    What follows the EOS (the pad ``generate`` fills finished rows with) is not counted."""
    eos = set(int(e) for e in eos_ids)
    out = []
    for row in generated.tolist():
        cut = next((j for j, t in enumerate(row) if t in eos), None)
        out.append((row, len(row)) if cut is None else (row[:cut], cut + 1))
    return out


def pad_token_id(tokenizer, eos_ids) -> int:
    """The tokenizer's pad token, else its EOS (the usual choice for models without one), else token 0."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int):
            return candidate
    return min(eos_ids) if eos_ids else 0


def hf_generate_batch(model, batch: list[list[int]], max_new_tokens: int, *, pad_id: int, eos_ids,
                      temperature: float = 0.0, top_p: float = 1.0) -> list[tuple[list[int], int]]:
    """transformers ``generate`` on one batch of token-id prompts, left-padded: greedy at temperature 0, else
    sampling at ``temperature`` / ``top_p`` without top-k (as our sampling). Stops at any of ``eos_ids`` (the
    generator's: the tokenizer's and the generation config's). Returns ``split_new_tokens`` of the output."""
    dev = next(model.parameters()).device
    ids, mask = left_pad(batch, pad_id, dev)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if temperature > 0 else \
        dict(do_sample=False)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=0,
                             pad_token_id=pad_id, eos_token_id=sorted(eos_ids) or None, **sampling)
    return split_new_tokens(out[:, ids.shape[1]:], eos_ids)


# ------------------------------------------------------------------------------------------------- runs


def _configs(methods: list[str], fsd: list[tuple[str, float]]) -> list[tuple[str, str | None, float | None, dict]]:
    """(method, divergence, threshold, generate keywords) in the order they run at each batch size: AR first
    (every other row's ``vs_ar`` needs it), transformers last."""
    from fsd_eagle.config import FuzzyConfig

    out = []
    if "ar" in methods:
        out.append(("ar", None, None, dict(autoregressive=True)))
    if "eagle2" in methods:
        out.append(("eagle2", None, 0.0, {}))
    if "fsd" in methods:
        out += [("fsd", d, t, dict(fuzzy=FuzzyConfig(threshold=t, divergence=d))) for d, t in fsd]
    if "hf" in methods:
        out.append(("hf_generate", None, None, {}))
    return out


def row_key(row: dict) -> tuple:
    """What identifies a row within one file (its settings are the file's)."""
    return row["method"], row.get("divergence"), row.get("threshold"), row["batch_size"]


def _warm_prompts(encoded: list[list[int]], batch_size: int) -> list[list[int]]:
    """The ``batch_size`` longest prompts: the warm-up allocates the largest caches the timed run needs."""
    order = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    return [encoded[i] for i in sorted(order[:batch_size])]


def measure_ours(gen, encoded: list[list[int]], batch_size: int, max_new_tokens: int, kwargs: dict, *,
                 temperature: float, top_p: float, seed: int, warmup: int, mt_bench: int = 0) -> dict:
    """One ``generate`` call over every prompt, ``batch_size`` at a time, timed as a whole. Before it, with
    ``warmup`` > 0: that many untimed calls on one batch of the longest prompts (the largest caches, graph
    capture and compilation of the rounds), then a 2-token call over every prompt in the timed run's batches
    (as eval/speed.py does) and the capture of every prefill graph the timed run may meet (each number of
    prefill rows at each prompt-length bucket, ``Session.prepare_prefills``: which ones it meets depends on
    when rows finish), so that none of this is timed.

    ``mt_bench`` > 0 at batch size 1: also the tokens/s and tau of the first ``mt_bench`` prompts alone (MT-bench's
    first turns, the speed benchmark's set): their new tokens over the sum of their own decoding times
    (``DecodeStats.elapsed_s``; one prompt decodes at a time, so these do not overlap)."""
    dev = gen.target.device
    sampling = dict(temperature=temperature, top_p=top_p if temperature else 1.0)
    # The Session the call runs on: its tree is the batch size's preset (None where it decodes without drafting).
    session = gen.session(batch=batch_size, **sampling, **{k: v for k, v in kwargs.items()
                                                          if k in ("autoregressive", "fuzzy")})
    for _ in range(warmup):
        gen.generate(_warm_prompts(encoded, batch_size), max_new_tokens, batch_size=batch_size, chat=False,
                     seed=seed, **sampling, **kwargs)
    if warmup:
        gen.generate(encoded, min(2, max_new_tokens), batch_size=batch_size, chat=False, seed=seed, **sampling,
                     **kwargs)
        session.prepare_prefills(len(p) for p in encoded)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    seeds = [seed + i for i in range(len(encoded))]  # prompt i is decoded with seed + i, whatever its batch
    sync(dev)
    session.clock.start()
    t = time.perf_counter()
    results = gen.generate(encoded, max_new_tokens, batch_size=batch_size, chat=False, seed=seeds, **sampling,
                           **kwargs)
    sync(dev)
    wall = time.perf_counter() - t
    session.clock.stop()
    spent = session.clock.totals()
    new = sum(r.stats.new_tokens for r in results)
    forwards = sum(r.stats.target_forwards for r in results)
    first = results[:mt_bench] if batch_size == 1 else []
    first_new, first_s = sum(r.stats.new_tokens for r in first), sum(r.stats.elapsed_s for r in first)
    first_forwards = sum(r.stats.target_forwards for r in first)
    return {"new_tokens": new, "wall_s": wall, "tau": new / forwards if forwards else None,
            "mt_bench": dict(mt_bench_prompts=len(first) or None,
                             mt_bench_tokens_per_s=round(first_new / first_s, 2) if first_s > 0 else None,
                             mt_bench_tau=round(first_new / first_forwards, 3) if first_forwards else None),
            "peak_mem_gb": _peak(dev), "prompts": len(encoded),
            "tree": session.tree.to_dict() if session.drafter is not None else None,
            "mode": results[-1].stats.mode, "attention": results[-1].stats.attention, "spent": spent}


def measure_hf(gen, encoded: list[list[int]], batch_size: int, max_new_tokens: int, *, temperature: float,
               top_p: float, seed: int, warmup: int) -> dict:
    """transformers ``generate`` on the target model over ``encoded`` in batches of ``batch_size``, timed as
    a whole (after ``warmup`` untimed batches of 16 tokens)."""
    model, dev = gen.target.model, gen.target.device
    kw = dict(pad_id=pad_token_id(gen.tokenizer, gen.eos_ids), eos_ids=gen.eos_ids, temperature=temperature,
              top_p=top_p)
    for _ in range(warmup):
        hf_generate_batch(model, _warm_prompts(encoded, batch_size), min(16, max_new_tokens), **kw)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(seed)
    sync(dev)
    t = time.perf_counter()
    new = 0
    for start in range(0, len(encoded), batch_size):
        new += sum(n for _, n in hf_generate_batch(model, encoded[start:start + batch_size], max_new_tokens, **kw))
    sync(dev)
    wall = time.perf_counter() - t
    return {"new_tokens": new, "wall_s": wall, "tau": None, "peak_mem_gb": _peak(dev), "prompts": len(encoded),
            "tree": None, "mode": "hf", "attention": None, "spent": None,
            "mt_bench": dict(mt_bench_prompts=None, mt_bench_tokens_per_s=None, mt_bench_tau=None)}


def time_split(spent: dict | None, wall_s: float) -> dict:
    """Where a timed run's wall time went (``Session.clock`` totals; our methods only): ``prefill_s`` and
    ``round_s`` (device seconds in prefills and rounds; host seconds on the CPU), ``prefills`` and ``rounds``
    (how many), ``ms_per_round``, and ``other_s``: the wall time outside both (the device waiting for the
    host, the last rows alone at the end). None for transformers' generate."""
    if spent is None:
        return dict(prefill_s=None, prefills=None, round_s=None, rounds=None, ms_per_round=None, other_s=None)
    rounds = spent["rounds"]
    return dict(prefill_s=round(spent["prefill_s"], 3), prefills=spent["prefills"], round_s=round(spent["round_s"], 3),
                rounds=rounds, ms_per_round=round(1e3 * spent["round_s"] / rounds, 3) if rounds else None,
                other_s=round(wall_s - spent["prefill_s"] - spent["round_s"], 3))


def _peak(dev: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 3) if dev.type == "cuda" else None


def annotate(rows: list[dict]) -> list[dict]:
    """Rows with ``vs_ar``: tokens/s over the AR row of the same batch size (None without one)."""
    ar = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["method"] == "ar"}
    out = []
    for r in rows:
        base = ar.get(r["batch_size"])
        out.append({**r, "vs_ar": round(r["tokens_per_s"] / base, 3) if base else None})
    return out


def format_table(rows: list[dict]) -> str:
    """The rows as an aligned text table, by batch size."""
    head = ("method", "div", "T", "batch", "prompts", "tok/s", "vs AR", "tau", "peak GB", "wall s")
    lines = [[r["method"], r.get("divergence") or "-",
              "-" if r.get("threshold") is None else format_threshold(float(r["threshold"])), str(r["batch_size"]),
              str(r["prompts"]), f"{r['tokens_per_s']:.1f}", "-" if r.get("vs_ar") is None else f"{r['vs_ar']:.2f}",
              "-" if r.get("tau") is None else f"{r['tau']:.2f}",
              "-" if r.get("peak_mem_gb") is None else f"{r['peak_mem_gb']:.2f}", f"{r['wall_s']:.1f}"]
             for r in sorted(rows, key=lambda r: r["batch_size"])]
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:{'<' if i < 3 else '>'}{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*line) for line in [head, *lines])


def read_existing(path: Path, settings: dict) -> tuple[list[dict], list[dict]]:
    """Rows and earlier run headers of a result file made with ``settings`` (nothing when there is no file);
    refuses a file made with other settings, or one that is not a batch result file."""
    if not path.is_file():
        return [], []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        meta, rows = data["meta"], data["rows"]
        old = meta["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        raise InputError(f"{path} is not a result file of python -m eval batch: use another --output") from None
    if old != settings:
        diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff)
        raise ConfigError(f"{path} holds rows measured with other settings ({shown}); use another --output, "
                          f"the same settings, or no --resume to start afresh")
    earlier = [{k: v for k, v in meta.items() if k != "earlier_runs"}] + list(meta.get("earlier_runs", []))
    return list(rows), earlier


def run_batch(gen, prompts: list[str], batch_sizes: list[int], methods: list[str], fsd: list[tuple[str, float]],
              *, output: Path, max_new_tokens: int, hf_limit: int | None = None, temperature: float = 0.0,
              top_p: float = 1.0, seed: int = 0, warmup: int = 1, resume: bool = False, settings: dict,
              meta: dict, mt_bench: int = 0, log=print) -> list[dict]:
    """Measure every (batch size, method) not yet in ``output`` (with ``resume``), rewriting the file after each
    row; returns all its rows, annotated. ``mt_bench``: the batch-1 rows also time the first ``mt_bench``
    prompts alone (``measure_ours``)."""
    encoded = [gen.encode(p) for p in prompts]
    settings = json.loads(json.dumps(settings))  # as it reads back from the file
    rows, earlier = read_existing(output, settings) if resume else ([], [])
    done = {row_key(r) for r in rows}
    meta = {**meta, "settings": settings, **({"earlier_runs": earlier} if earlier else {})}
    device, dtype = device_label(gen.target.device), str(gen.target.dtype).replace("torch.", "")
    sampling = dict(temperature=temperature, top_p=top_p, seed=seed, warmup=warmup)
    for batch_size in batch_sizes:
        for method, divergence, threshold, kwargs in _configs(methods, fsd):
            row = {"method": method, "divergence": divergence, "threshold": threshold_to_json(threshold),
                   "batch_size": batch_size}
            if row_key(row) in done:
                continue
            if method == "hf_generate":
                n = len(encoded) if hf_limit is None else min(len(encoded), max(batch_size, hf_limit))
                m = measure_hf(gen, encoded[:n], batch_size, max_new_tokens, **sampling)
            else:
                m = measure_ours(gen, encoded, batch_size, max_new_tokens, kwargs, mt_bench=mt_bench, **sampling)
            row.update(tokens_per_s=round(m["new_tokens"] / m["wall_s"], 2),
                       tau=None if m["tau"] is None else round(m["tau"], 3), peak_mem_gb=m["peak_mem_gb"],
                       prompts=m["prompts"], max_new_tokens=max_new_tokens, device=device, dtype=dtype,
                       tree=m["tree"], new_tokens=m["new_tokens"], wall_s=round(m["wall_s"], 3),
                       temperature=temperature, compile=bool(gen.compile), mode=m["mode"], attention=m["attention"],
                       **time_split(m["spent"], m["wall_s"]), **m["mt_bench"])
            rows.append(row)
            done.add(row_key(row))
            write_json_atomic(output, {"meta": meta, "rows": annotate(rows)})
            shown = annotate(rows)[-1]
            log(f"batch {batch_size:3d}  {method:11s} {divergence or '':10s} "
                f"{'' if threshold is None else format_threshold(threshold):4s} {shown['tokens_per_s']:10.1f} tok/s  "
                f"vs AR {shown['vs_ar']}  tau {shown['tau']}  mem {shown['peak_mem_gb']}  {m['prompts']} prompts  "
                f"{shown['wall_s']:.1f} s" + ("" if shown["rounds"] is None else
                f" (prefills {shown['prefill_s']:.1f} s, {shown['rounds']} rounds of {shown['ms_per_round']} ms)")
                + ("" if shown["mt_bench_prompts"] is None else
                   f"; MT-bench's {shown['mt_bench_prompts']} alone {shown['mt_bench_tokens_per_s']} tok/s, "
                   f"tau {shown['mt_bench_tau']}"))
    rows = annotate(rows)
    if not rows:  # nothing measured and nothing resumed: still a valid file
        write_json_atomic(output, {"meta": meta, "rows": rows})
    return rows


# -------------------------------------------------------------------------------------------------- CLI


def _int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"error: {flag} takes comma-separated integers >= 1, got {text!r}")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m eval batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="local transformers model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--head", help="draft head folder (default: the shipped head of the default target)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: SpeculativeGenerator.load's)")
    p.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help=f"default {DEFAULT_BATCH_SIZES}")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of ar,eagle2,fsd,hf")
    p.add_argument("--fsd", default="reverse_kl:1", help="FSD rows as divergence:threshold pairs "
                                                         "(e.g. reverse_kl:1,kl:1; default reverse_kl:1)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, default=480, help="prompts: MT-bench first turns, then Spec-Bench "
                                                          "(default 480: all)")
    p.add_argument("--hf-limit", type=int, help="transformers generate on the first max(batch size, N) prompts "
                                                "only (default: all; it is ~50-70x slower at batch 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p when temperature > 0")
    p.add_argument("--seed", type=int, default=0, help="sampling: prompt i is decoded with seed + i")
    add_tree_arguments(p)
    p.add_argument("--compile", action="store_true", help="compile rounds with torch.compile (GPU)")
    p.add_argument("--attention", choices=("sdpa", "flex"),
                   help="tree attention of compiled rounds (default: the library's choice per batch size, "
                        "SpeculativeGenerator.use_attention)")
    p.add_argument("--warmup", type=int, nargs="?", const=1, default=1, metavar="N",
                   help="untimed batches of the longest prompts per configuration before its timed run, then a "
                        "2-token pass over every prompt (prefill graphs), so that graph capture and compilation "
                        "are not timed (default 1; 0 = neither)")
    p.add_argument("--output", help="result file (default: eval/results/gpu_batch.json on a GPU, cpu_batch.json "
                                    "on the CPU)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of --output (same settings) and measure only the missing ones")
    p.add_argument("--code", help="commit to record (default: git rev-parse HEAD; for a copy whose .git is stale)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parser().parse_args(argv)
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.cli import quiet_transformers

    batch_sizes = _int_list(a.batch_sizes, "--batch-sizes")
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise SystemExit(f"error: --methods takes a comma-separated subset of {','.join(METHODS)}, got {a.methods!r}")
    fsd = parse_fsd(a.fsd) if "fsd" in methods else []
    for flag, value in (("--max-new-tokens", a.max_new_tokens), ("--limit", a.limit), ("--hf-limit", a.hf_limit)):
        if value is not None and value < 1:
            raise SystemExit(f"error: {flag} must be at least 1")
    if a.warmup < 0:
        raise SystemExit("error: --warmup must be 0 or more")
    quiet_transformers()
    gen = SpeculativeGenerator.load(target=a.target, head=a.head, device=a.device, dtype=a.dtype, threads=a.threads,
                                    compile=a.compile)
    gen.use_attention(a.attention)
    tree = gen.set_tree(a.total_tokens, a.depth, a.tree_top_k, a.draft_vocab)
    dev = gen.target.device
    output = Path(a.output) if a.output else ROOT / "eval" / "results" / (
        "gpu_batch.json" if dev.type == "cuda" else "cpu_batch.json")
    prompts = load_prompts(a.limit)
    device, dtype = device_label(dev), str(gen.target.dtype).replace("torch.", "")
    settings = {"target": a.target, "head": a.head, "device": device, "dtype": dtype,
                "threads": torch.get_num_threads(),
                "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "hf_limit": a.hf_limit,
                "temperature": a.temperature, "top_p": a.top_p if a.temperature else 1.0, "seed": a.seed,
                "tree": tree.to_dict(), "compile": a.compile, "attention": a.attention, "inductor_freezing": freezing(),
                "warmup": a.warmup}
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": "python -m eval batch " + " ".join(argv), "git_commit": a.code or git_commit(),
            **versions(), "device": device, "dtype": dtype}
    print(f"{len(prompts)} prompts, batch sizes {batch_sizes}, tree {tree.to_dict()}, {device}, {dtype}, "
          f"writing {output}", flush=True)
    mt_bench = min(len(prompts), len(load_mt_bench()))  # the prompt set starts with MT-bench's first turns
    rows = run_batch(gen, prompts, batch_sizes, methods, fsd, output=output, max_new_tokens=a.max_new_tokens,
                     mt_bench=mt_bench, hf_limit=a.hf_limit, temperature=a.temperature, top_p=a.top_p, seed=a.seed,
                     warmup=a.warmup, resume=a.resume, settings=settings, meta=meta, log=lambda s: print(s, flush=True))
    print()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
