"""Sweep results: per-question records -> one row per (method, divergence, threshold) -> JSON, markdown, plot.

    python -m eval table --out eval/results/sweep [--speed speed.json]

Rows are always recomputed from the per-question records under ``OUT/raw/`` (so a killed sweep can be
reported too). Row keys:

* identity: ``config``, ``method`` (ar / eagle2 / fsd), ``divergence``, ``threshold`` (``"inf"`` for
  infinity; 0 for eagle2; None for ar);
* speed: ``tokens_per_s`` = total new tokens / total decode seconds of the row's questions decoded one at a
  time (records of a ``--batch-size`` run, decoded in a batch, do not count: None when every question was;
  ``timed`` = how many did count, ``batched`` = how many were decoded in a batch), ``speedup_vs_ar`` = that
  over the AR row's,
  ``speed_source`` (where those two figures come from), ``tau`` = total new tokens / total target forwards
  (all questions), ``fuzzy_accepted`` (tokens accepted only by the fuzzy rule) and ``fuzzy_per_token``,
  ``divergence_mean`` (mean D at verified nodes); per task ``tau_<task>`` and ``fuzzy_per_token_<task>``;
* accuracy: ``gsm8k_acc``, ``mmlu_acc``, ``humaneval_pass1``, ``arith_acc`` (None for a task not run), each with ``*_se``
  (binomial standard error), and ``n`` ({task: questions});
* fidelity: ``agreement`` (mean per-question greedy token agreement with the AR output of the same question,
  :func:`eval.metrics.token_agreement`; over the questions that have an AR record) and ``nll`` (the target's
  mean NLL per generated token, nats, token-weighted over all questions), also per task
  (``agreement_gsm8k``, ``nll_gsm8k``, ...);
* ``vs_eagle2``: {task: {"delta", "se", "n"}}, the paired accuracy difference to exact EAGLE-2 over the
  questions both ran, used by the claim check of the markdown report.

Speed hook: a sweep with several workers shares one device, so its speed figures are contended; one with
``--batch-size`` > 1 has no single-prompt speed for the questions it decoded in batches. A separate
single-process speed run can be merged: ``--speed FILE`` (or a file ``OUT/speed.json``, merged
automatically) holding ``{"meta": {"source": "..."}, "rows": [...]}`` or a bare list of rows, each with
``method``, ``divergence``, ``threshold`` (or ``config``) and ``tokens_per_s`` (plus optional
``speedup_vs_ar`` and any other ``tokens_per_s*`` / ``speedup*`` / ``speed_*`` keys, e.g. a spread). Merged
rows keep the sweep's own figures as ``tokens_per_s_concurrent`` / ``speedup_vs_ar_concurrent``.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from fsd_eagle.errors import InputError
from fsd_eagle.jsonl import write_text_atomic

from .metrics import token_agreement
from .runinfo import write_json_atomic
from .sweep_store import (RUNS_FILE, SETTINGS_FILE, TASKS, Config, ResultStore, format_threshold,
                          threshold_from_json)

ACC_KEYS = {"gsm8k": "gsm8k_acc", "mmlu": "mmlu_acc", "humaneval": "humaneval_pass1", "arith": "arith_acc"}
TASK_TITLES = {"gsm8k": "GSM8K", "mmlu": "MMLU", "humaneval": "HumanEval pass@1", "arith": "Arithmetic"}
_METHOD_ORDER = {"ar": 0, "eagle2": 1, "fsd": 2}
SPEEDUP_CLAIM = 1.15  # the paper's question: >= 15% more tokens per second than exact EAGLE-2 ...
NOISE_Z = 1.96  # ... with an accuracy drop no larger than this many paired standard errors
MIN_CLAIM_N = 30  # questions per task below which the claim check gives no answer
ACC_LOSS_BUDGET = 0.02  # the paper's other claim: a clear speed margin at about 2 points of accuracy lost
# Reverse KL in TensorRT-LLM pull request 12853 (the FSD authors' implementation there, classic SD): tokens/s over
# exact SD at each threshold; acceptance length 3.98 for SD and 4.98 at T = 4.
PR_REVERSE_KL_GAIN = {1.0: 0.08, 2.0: 0.25, 3.0: 0.31, 4.0: 0.32}


def _round(x, digits: int = 4):
    return None if x is None else round(float(x), digits)


def row_order(row: dict) -> tuple:
    t = threshold_from_json(row.get("threshold"))
    return (_METHOD_ORDER.get(row["method"], 9), row.get("divergence") or "", -1.0 if t is None else t)


def concurrent_source(meta: dict | None) -> str:
    meta = meta or {}
    workers = meta.get("workers")
    device = meta.get("device", "the device")
    if workers and workers > 1:
        text = (f"sweep: {workers} concurrent workers on one {device}; contended, not a clean speed measure "
                f"(merge a single-process speed run with `python -m eval table --speed FILE`)")
    else:
        text = f"sweep: 1 process on {device}; decode time only, no repeats"
    if any((run.get("batch_size") or 1) > 1 for run in meta.get("runs") or [meta]):
        text += ("; questions decoded in batches (--batch-size) are left out of tok/s: they have no "
                 "single-prompt speed")
    return text


def is_single_prompt_time(record: dict) -> bool:
    """Whether a record's ``elapsed_s`` is the time of its question decoded alone (not in a batch, no error)."""
    return ((record.get("batch_size") or 1) == 1 and isinstance(record.get("elapsed_s"), (int, float))
            and "error" not in record)


def aggregate(records: Iterable[dict], meta: dict | None = None) -> list[dict]:
    """One row per config from per-question records (see the module docstring for the keys)."""
    by_cfg: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_cfg[r["config"]].append(r)
    ar_ids = {(r["task"], str(r["qid"])): r["token_ids"] for r in by_cfg.get("ar", []) if "error" not in r}
    e2_correct = {(r["task"], str(r["qid"])): bool(r.get("correct")) for r in by_cfg.get("eagle2", [])}
    rows = []
    for key, recs in by_cfg.items():
        first = recs[0]
        row = {"config": key, "method": first["method"], "divergence": first.get("divergence"),
               "threshold": first.get("threshold")}
        new = sum(r.get("new_tokens", 0) for r in recs)
        timed = [r for r in recs if is_single_prompt_time(r)]
        timed_new = sum(r.get("new_tokens", 0) for r in timed)
        secs = sum(r["elapsed_s"] for r in timed)
        forwards = sum(r.get("target_forwards", 0) for r in recs)
        fuzzy = sum(r.get("fuzzy_accepted", 0) for r in recs)
        div_n = sum(r.get("divergence_count", 0) for r in recs)
        div_sum = sum(r.get("divergence_sum", 0.0) for r in recs)
        row.update(tokens_per_s=_round(timed_new / secs, 2) if secs > 0 else None, speedup_vs_ar=None,
                   speed_source=None, tau=_round(new / forwards) if forwards else None, fuzzy_accepted=fuzzy,
                   fuzzy_per_token=_round(fuzzy / new) if new else None,
                   divergence_mean=_round(div_sum / div_n, 6) if div_n else None)
        row["n"] = {}
        agree_all: list[float] = []
        nll_sum_all, nll_n_all = 0.0, 0
        row["vs_eagle2"] = {}
        for task in TASKS:
            rs = [r for r in recs if r["task"] == task]
            acc_key = ACC_KEYS[task]
            if not rs:
                row[acc_key] = row[acc_key + "_se"] = None
                continue
            n = len(rs)
            row["n"][task] = n
            task_new = sum(r.get("new_tokens", 0) for r in rs)
            task_forwards = sum(r.get("target_forwards", 0) for r in rs)
            row[f"tau_{task}"] = _round(task_new / task_forwards) if task_forwards else None
            row[f"fuzzy_per_token_{task}"] = (_round(sum(r.get("fuzzy_accepted", 0) for r in rs) / task_new)
                                             if task_new else None)
            acc = sum(bool(r.get("correct")) for r in rs) / n
            row[acc_key] = _round(acc)
            row[acc_key + "_se"] = _round(math.sqrt(acc * (1 - acc) / n))
            agree = [token_agreement(r.get("token_ids", []), ar_ids[(task, str(r["qid"]))]) for r in rs
                     if (task, str(r["qid"])) in ar_ids and "error" not in r]
            row[f"agreement_{task}"] = _round(sum(agree) / len(agree)) if agree else None
            agree_all += agree
            s, k = sum(r.get("nll_sum", 0.0) for r in rs), sum(r.get("nll_tokens", 0) for r in rs)
            row[f"nll_{task}"] = _round(s / k) if k else None
            nll_sum_all += s
            nll_n_all += k
            diffs = [int(bool(r.get("correct"))) - int(e2_correct[(task, str(r["qid"]))]) for r in rs
                     if (task, str(r["qid"])) in e2_correct]
            if diffs:
                mean = sum(diffs) / len(diffs)
                se = (math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
                      if len(diffs) > 1 else None)
                row["vs_eagle2"][task] = {"delta": _round(mean), "se": _round(se), "n": len(diffs)}
        row["agreement"] = _round(sum(agree_all) / len(agree_all)) if agree_all else None
        row["n_agreement"] = len(agree_all)
        row["nll"] = _round(nll_sum_all / nll_n_all) if nll_n_all else None
        row.update(new_tokens=new, decode_s=_round(secs, 3), timed=len(timed),
                   batched=sum((r.get("batch_size") or 1) > 1 for r in recs),
                   target_forwards=forwards, errors=sum("error" in r for r in recs))
        rows.append(row)
    rows.sort(key=row_order)
    _set_speedups(rows, concurrent_source(meta))
    return rows


def _set_speedups(rows: list[dict], source: str) -> None:
    ar = next((r for r in rows if r["method"] == "ar"), None)
    base = ar.get("tokens_per_s") if ar else None
    for r in rows:
        tps = r.get("tokens_per_s")
        r["speedup_vs_ar"] = _round(tps / base, 3) if base and tps is not None else None
        r["speed_source"] = source


# --------------------------------------------------------------------------------------------- speed hook


_SPEED_NAME = re.compile(r"^(?:(?P<plain>ar|eagle2)|fsd_(?P<div>[a-z_]+?)_T(?P<t>[^_]+))(?:_(?P<variant>compiled|graph|eager))?$")


def _speed_key(row: dict, temperature: float = 0.0, children: str = "top") -> tuple[str, int] | None:
    """(config key, preference) of a speed row, or None for a row that is no sweep config (``hf_generate``).
    Rows are ours (``method`` ar / eagle2 / fsd with ``divergence``, ``threshold`` and ``backend``, or
    ``config``) or older eval/speed.py names: ``ar_graph``, ``eagle2_eager``, ``fsd_kl_T1.0_compiled``; the
    fastest backend is preferred: compiled, then CUDA graph, then eager. Rows of another temperature than the
    sweep's (``temperature``; 0 = greedy), or with other draft children (``children``: top or sampled, for
    drafting rows at temperature > 0), are skipped: their speed is no measure of its configs."""
    if row.get("config"):
        return str(row["config"]), 0
    if float(row.get("temperature") or 0.0) != float(temperature):
        return None
    if temperature and row.get("method") != "ar" and row.get("children", "top") != children:
        return None
    method = str(row.get("method", ""))
    if method in ("ar", "eagle2", "fsd"):
        threshold = 0.0 if method == "eagle2" else threshold_from_json(row.get("threshold"))
        rank = {"compiled": 0, "graph": 1, None: 2, "eager": 3}.get(row.get("backend"), 2)
        return Config(method, row.get("divergence") if method == "fsd" else None, threshold).key, rank
    m = _SPEED_NAME.match(method)
    if m is None:
        return None
    rank = {"compiled": 0, "graph": 1, None: 2, "eager": 3}[m["variant"]]
    if m["plain"]:
        return m["plain"], rank
    try:
        threshold = threshold_from_json(m["t"])
    except ValueError:
        return None
    return Config("fsd", m["div"], threshold).key, rank


def merge_speed(rows: list[dict], speed: dict | list, source: str, temperature: float = 0.0,
                children: str = "top") -> int:
    """Replace the rows' speed figures by those of a single-process speed run (see the module docstring);
    returns the number of rows merged. Rows the speed run does not cover keep the sweep's figures (the
    markdown table says which rows come from where); only speed rows at the sweep's ``temperature`` count."""
    speed_rows = speed.get("rows", []) if isinstance(speed, dict) else list(speed)
    meta = speed.get("meta", {}) if isinstance(speed, dict) else {}
    label = meta.get("source") or source
    details = ", ".join(f"{k} {meta[k]}" for k in ("device", "date", "prompt_source", "prompts", "repeats")
                        if meta.get(k) is not None)
    if details and not meta.get("source"):
        label += f" ({details})"
    by_key: dict[str, tuple[int, dict]] = {}
    for s in speed_rows:
        if not isinstance(s, dict) or ("method" not in s and "config" not in s):
            raise InputError(f"speed rows need 'method' (or 'config'); got {s!r:.80}")
        key = _speed_key(s, temperature, children)
        if key is not None and (key[0] not in by_key or key[1] < by_key[key[0]][0]):
            by_key[key[0]] = (key[1], s)
    merged = 0
    for row in rows:
        s = by_key.get(row["config"], (0, None))[1]
        if s is None or s.get("tokens_per_s") is None:
            continue
        row["tokens_per_s_concurrent"] = row.get("tokens_per_s")
        row["speedup_vs_ar_concurrent"] = row.get("speedup_vs_ar")
        for k, v in s.items():
            if k.startswith(("tokens_per_s", "speedup", "speed_")):
                row[k] = v
        row["speedup_vs_ar"] = s.get("speedup_vs_ar")
        row["speed_source"] = label
        row["speed_method"] = s.get("name", s.get("method", s.get("config")))
        merged += 1
    ar = next((r for r in rows if r["method"] == "ar" and r.get("speed_source") == label), None)
    for row in rows:
        if row.get("speed_source") == label and row.get("speedup_vs_ar") is None and ar and ar["tokens_per_s"]:
            row["speedup_vs_ar"] = _round(row["tokens_per_s"] / ar["tokens_per_s"], 3)
    return merged


# ----------------------------------------------------------------------------------------------- results


def read_runs(out: Path) -> list[dict]:
    path = out / RUNS_FILE
    runs = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                runs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return runs


def build_results(out: Path | str, speed: Path | str | None = None) -> dict:
    """{"meta": ..., "rows": [...]} from OUT/raw, OUT/runs.jsonl and a speed file (``speed`` or
    OUT/speed.json)."""
    out = Path(out)
    store = ResultStore(out)
    records = store.records()
    if not records:
        raise InputError(f"no sweep results under {out / 'raw'}")
    runs = read_runs(out)
    meta = dict(runs[-1]) if runs else {}
    if "settings" not in meta and (out / SETTINGS_FILE).is_file():  # a run killed before writing its entry
        meta["settings"] = json.loads((out / SETTINGS_FILE).read_text())
    for run in reversed(runs):  # a resumed run with nothing left to do loaded no model: take the model's
        for key in ("tree", "torch_device", "model_dtype"):  # details from the last run that did
            if key not in meta and key in run:
                meta[key] = run[key]
    if runs:
        meta["runs"] = [{k: r.get(k) for k in ("date", "command", "device", "workers", "batch_size", "wall_s",
                                                "jobs_total", "jobs_skipped")} for r in runs]
    rows = aggregate(records, meta)
    speed_path = Path(speed) if speed else (out / "speed.json" if (out / "speed.json").is_file() else None)
    if speed_path is not None:
        try:
            data = json.loads(speed_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"cannot read the speed file {speed_path}: {e}") from None
        settings = meta.get("settings", {})
        n = merge_speed(rows, data, f"single-process speed run ({speed_path.name})",
                        float(settings.get("temperature") or 0.0), settings.get("children", "top"))
        meta["speed_file"] = str(speed_path)
        meta["speed_rows_merged"] = n
    return {"meta": meta, "rows": rows}


def write_outputs(out: Path | str, results: dict, plot: bool = True) -> list[Path]:
    """results.json, results.md and (when matplotlib is installed) accuracy_vs_speed.png in ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    written.append(write_json_atomic(out / "results.json", results))
    path = out / "results.md"
    write_text_atomic(path, render_markdown(results))
    written.append(path)
    if plot:
        png = plot_accuracy_vs_speed(results, out / "accuracy_vs_speed.png")
        if png is not None:
            written.append(png)
    return written


# ---------------------------------------------------------------------------------------------- markdown


def _pct(x, se=None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f} ± {100 * se:.1f}" if se is not None else f"{100 * x:.1f}"


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_markdown(results: dict) -> str:
    """A markdown report: run metadata, the table, and the paper's claim checked against exact EAGLE-2."""
    meta, rows = results.get("meta", {}), results["rows"]
    tasks = [t for t in TASKS if any(t in r["n"] for r in rows)]
    settings = meta.get("settings", {})
    drafter = (f"draft model {settings['draft_model']}" if settings.get("draft_model")
               else f"head {settings.get('head', '?')}")
    lines = [f"# FSD sweep: target {settings.get('target', '?')}, {drafter}", ""]
    lines.append(f"- device: {meta.get('device', '?')}; dtype {settings.get('dtype', '?')}; "
                 f"tree {meta.get('tree', settings.get('tree', '?'))}; fuzzy mode {settings.get('fuzzy_mode', '?')}")
    lines.append(f"- date {meta.get('date', '?')}; torch {meta.get('torch', '?')}, transformers "
                 f"{meta.get('transformers', '?')}, fsd_eagle {meta.get('fsd_eagle', '?')}; seed {meta.get('seed', '?')}"
                 f"; git {str(meta.get('git_commit') or '?')[:12]}")
    if meta.get("command"):
        lines.append(f"- command: `{meta['command']}`")
    if settings.get("max_new_tokens"):
        lines.append("- max new tokens: " + ", ".join(f"{t} {n}" for t, n in settings["max_new_tokens"].items()
                                                      if t in tasks))
    sources = list(dict.fromkeys(r.get("speed_source") or "?" for r in rows))
    if len(sources) == 1:
        lines.append("- speed (tok/s, speedup): " + sources[0])
    else:  # some rows from a merged speed run, others from the sweep: the column "speed" says which
        lines += [f"- speed [{i}] (tok/s, speedup): {src}" for i, src in enumerate(sources, 1)]
    temperature = settings.get("temperature")
    decoding = (f"sampling at temperature {temperature:g} (seed {meta.get('seed', '?')} for every question"
                + ("; draft tokens sampled from the drafter" if settings.get("children") == "sampled" else "")
                + ")" if temperature else "greedy decoding")
    lines.append(f"- {decoding}; accuracy in % ± binomial standard error; agreement = token agreement "
                 "with the AR output of the same question; NLL = the target's mean NLL per generated token (nats)")
    lines.append("")
    head = ["method", "divergence", "T", "tok/s", "speedup vs AR", "tau", "fuzzy/token"]
    head += [TASK_TITLES[t] for t in tasks] + ["agreement", "NLL", "n"] + (["speed"] if len(sources) > 1 else [])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    exact_label = "sd" if settings.get("draft_model") else "eagle2"  # chain drafting by a draft LM: classic SD
    for r in rows:
        t = threshold_from_json(r.get("threshold"))
        method = exact_label if r["method"] == "eagle2" else r["method"]
        cells = [method, r.get("divergence") or "-", format_threshold(t), _num(r.get("tokens_per_s"), ".1f"),
                 _num(r.get("speedup_vs_ar"), ".2f"), _num(r.get("tau"), ".2f"), _num(r.get("fuzzy_per_token"), ".3f")]
        cells += [_pct(r.get(ACC_KEYS[task]), r.get(ACC_KEYS[task] + "_se")) for task in tasks]
        cells += [_num(r.get("agreement"), ".3f"), _num(r.get("nll"), ".3f"),
                  " ".join(f"{task}:{r['n'][task]}" for task in tasks if task in r["n"])]
        if len(sources) > 1:
            cells.append(f"[{sources.index(r.get('speed_source') or '?') + 1}]")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += per_task_table(rows, tasks, exact_label)
    baseline = "exact SD" if settings.get("draft_model") else "exact EAGLE-2"
    lines += claim_check(rows, tasks, baseline)
    lines += loss_budget_check(rows, tasks, baseline)
    lines += reverse_kl_vs_pr(rows, baseline)
    return "\n".join(lines) + "\n"


def per_task_table(rows: list[dict], tasks: list[str], exact_label: str = "eagle2") -> list[str]:
    """Markdown lines: tau and the fuzzy share per task (acceptance differs most between tasks; a speed run
    on one task's prompts is read against that task's tau). Nothing for a single task."""
    if len(tasks) < 2:
        return []
    head = ["method", "divergence", "T"]
    head += [f"tau {TASK_TITLES[t]}" for t in tasks] + [f"fuzzy/token {TASK_TITLES[t]}" for t in tasks]
    lines = ["Per task (tau = new tokens per target forward; fuzzy/token = share of tokens accepted by the "
             "fuzzy rule only):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        method = exact_label if r["method"] == "eagle2" else r["method"]
        cells = [method, r.get("divergence") or "-", format_threshold(threshold_from_json(r.get("threshold")))]
        cells += [_num(r.get(f"tau_{t}"), ".2f") for t in tasks]
        cells += [_num(r.get(f"fuzzy_per_token_{t}"), ".3f") for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _concurrent_tps(row: dict) -> float | None:
    """The row's tokens/s from the sweep itself (all rows measured under the same contention)."""
    return row["tokens_per_s_concurrent"] if "tokens_per_s_concurrent" in row else row.get("tokens_per_s")


def _speed_ratio(row: dict, base: dict) -> float | None:
    """tokens/s of ``row`` over ``base``, from one measurement source only: the merged single-process run
    when both rows have it, else the sweep's concurrent figures (never a mix of the two)."""
    if row.get("speed_source") == base.get("speed_source"):
        a, b = row.get("tokens_per_s"), base.get("tokens_per_s")
    else:
        a, b = _concurrent_tps(row), _concurrent_tps(base)
    return a / b if a is not None and b else None


def claim_check(rows: list[dict], tasks: list[str], baseline: str = "exact EAGLE-2") -> list[str]:
    """The paper's claim on this run: an FSD row whose accuracy drop against the exact rule (``baseline``:
    EAGLE-2's tree, or classic SD's chain, the method "eagle2" of the sweep) is within NOISE_Z paired
    standard errors on every task while its tokens per second is >= 1.15 x the exact rule's."""
    e2 = next((r for r in rows if r["method"] == "eagle2"), None)
    fsd = [r for r in rows if r["method"] == "fsd"]
    if e2 is None or not fsd or not tasks:
        return []
    short = baseline.removeprefix("exact ")
    lines = [f"## Claim check: accuracy within noise of {baseline} at >= 15% more tokens/s?", "",
             f"Accuracy within noise: on every task, paired difference to {short} (same questions) >= "
             f"-{NOISE_Z} x its standard error. Speed: tokens/s >= {SPEEDUP_CLAIM:.2f} x {short}'s, compared "
             f"within one measurement source: the single-process speed run where it covers both rows, else the "
             f"sweep's own (contended) figures.", ""]
    lines.append(f"| divergence | T | tok/s vs {short} | " + " | ".join(f"Δ {TASK_TITLES[t]} (pp)" for t in tasks)
                 + " | accuracy ok | speed ok |")
    lines.append("|" + "---|" * (5 + len(tasks)))
    passing = []
    for r in fsd:
        ratio = _speed_ratio(r, e2)
        cells, acc_ok = [], True
        for t in tasks:
            d = r["vs_eagle2"].get(t)
            if d is None:
                cells.append("-")
                acc_ok = False
                continue
            se = d["se"] or 0.0
            cells.append(f"{100 * d['delta']:+.1f} ± {100 * se:.1f}")
            acc_ok &= d["delta"] >= -NOISE_Z * se
        speed_ok = ratio is not None and ratio >= SPEEDUP_CLAIM
        if acc_ok and speed_ok:
            passing.append((r, ratio))
        lines.append(f"| {r['divergence']} | {format_threshold(threshold_from_json(r['threshold']))} | "
                     f"{_num(ratio, '.2f')} | " + " | ".join(cells) + f" | {'yes' if acc_ok else 'no'} | "
                     f"{'yes' if speed_ok else 'no'} |")
    lines.append("")
    fewest = min((d["n"] for r in fsd for d in r["vs_eagle2"].values()), default=0)
    if fewest < MIN_CLAIM_N:
        lines.append(f"**Answer: undetermined**: too few questions compared with {short} (fewest {fewest} on a task; "
                     f"at least {MIN_CLAIM_N} needed).")
    elif passing:
        best, ratio = max(passing, key=lambda x: x[1])
        lines.append(f"**Answer: yes** on this run: {best['divergence']} at T = "
                     f"{format_threshold(threshold_from_json(best['threshold']))} runs at {ratio:.2f} x {short}'s "
                     f"tokens/s with accuracy within noise.")
    else:
        lines.append(f"**Answer: no** on this run: no FSD setting is both within noise of {short}'s accuracy "
                     f"and >= {SPEEDUP_CLAIM:.2f} x its tokens/s.")
    lines.append("")
    return lines


def loss_budget_check(rows: list[dict], tasks: list[str], baseline: str = "exact EAGLE-2") -> list[str]:
    """The paper's other claim: FSD beats the exact rule by a clear tokens/s margin (>= 1.15 x) at about 2
    points of accuracy lost: the fastest FSD row whose accuracy (point estimate) is at most ACC_LOSS_BUDGET
    below the exact rule's on every task, over the same questions."""
    e2 = next((r for r in rows if r["method"] == "eagle2"), None)
    fsd = [r for r in rows if r["method"] == "fsd" and r.get("vs_eagle2")]
    if e2 is None or not fsd or not tasks:
        return []
    short = baseline.removeprefix("exact ")
    budget = 100 * ACC_LOSS_BUDGET
    lines = [f"## Claim check: >= 15% more tokens/s than {baseline} for at most {budget:g} points of accuracy?",
             ""]
    fewest = min(d["n"] for r in fsd for d in r["vs_eagle2"].values())
    within = [(r, _speed_ratio(r, e2)) for r in fsd
              if all(t in r["vs_eagle2"] and r["vs_eagle2"][t]["delta"] >= -ACC_LOSS_BUDGET for t in tasks)]
    within = [(r, ratio) for r, ratio in within if ratio is not None]
    if fewest < MIN_CLAIM_N:
        lines.append(f"**Answer: undetermined**: too few questions compared with {short} (fewest {fewest}; at "
                     f"least {MIN_CLAIM_N} needed).")
    elif not within:
        lines.append(f"**Answer: no** on this run: every FSD setting loses more than {budget:g} points on some "
                     "task (or has no speed figure).")
    else:
        best, ratio = max(within, key=lambda x: x[1])
        drops = ", ".join(f"{TASK_TITLES[t]} {100 * best['vs_eagle2'][t]['delta']:+.1f} pp" for t in tasks)
        verdict = "yes" if ratio >= SPEEDUP_CLAIM else "no"
        lines.append(f"**Answer: {verdict}** on this run: the fastest FSD setting within {budget:g} points, "
                     f"{best['divergence']} at T = {format_threshold(threshold_from_json(best['threshold']))}, "
                     f"runs at {ratio:.2f} x {short}'s tokens/s ({drops}).")
    lines.append("")
    return lines


def reverse_kl_vs_pr(rows: list[dict], baseline: str = "exact EAGLE-2") -> list[str]:
    """Our reverse-KL speedups over the exact rule next to those reported in TensorRT-LLM pull request 12853
    (PR_REVERSE_KL_GAIN: classic SD on the PR's model, so the comparison is of shape, not of numbers)."""
    e2 = next((r for r in rows if r["method"] == "eagle2"), None)
    rkl = {threshold_from_json(r["threshold"]): r for r in rows
           if r["method"] == "fsd" and r.get("divergence") == "reverse_kl"}
    shown = [t for t in sorted(rkl) if t in PR_REVERSE_KL_GAIN]
    if e2 is None or not shown:
        return []
    short = baseline.removeprefix("exact ")
    lines = ["## Reverse KL against TensorRT-LLM pull request 12853", "",
             f"tokens/s over {baseline} at each threshold, here and as reported in the PR (classic SD on its model; "
             f"acceptance length 3.98 exact, 4.98 at T = 4 there).", "",
             f"| T | here: tok/s vs {short} | here: tau ({short} {_num(e2.get('tau'), '.2f')}) | PR: tok/s vs SD |",
             "|---|---|---|---|"]
    for t in shown:
        ratio = _speed_ratio(rkl[t], e2)
        gain = "-" if ratio is None else f"{100 * (ratio - 1):+.0f}%"
        lines.append(f"| {format_threshold(t)} | {gain} | {_num(rkl[t].get('tau'), '.2f')} | "
                     f"+{100 * PR_REVERSE_KL_GAIN[t]:.0f}% |")
    lines.append("")
    return lines


# -------------------------------------------------------------------------------------------------- plot


def plot_accuracy_vs_speed(results: dict, path: Path | str) -> Path | None:
    """Accuracy (one panel per task, plus agreement with AR) against tokens per second; AR and exact EAGLE-2
    marked, FSD as one line per divergence labelled with T. Returns None (with a note) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed, skipping accuracy_vs_speed.png (pip install matplotlib)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged = [r for r in results["rows"] if "tokens_per_s_concurrent" in r]
    single = bool(merged) and len(merged) == len(results["rows"])  # every row from the single-process run
    speed_of = (lambda r: r.get("tokens_per_s")) if single else _concurrent_tps
    rows = [r for r in results["rows"] if speed_of(r) is not None]
    tasks = [t for t in TASKS if any(r.get(ACC_KEYS[t]) is not None for r in rows)]
    panels = [(ACC_KEYS[t], TASK_TITLES[t] + " (%)", 100.0) for t in tasks]
    if any(r.get("agreement") is not None for r in rows):
        panels.append(("agreement", "token agreement with AR", 1.0))
    if not panels:
        return None
    exact = ("SD (exact, chain of a draft LM)" if results.get("meta", {}).get("settings", {}).get("draft_model")
             else "EAGLE-2 (exact, T=0)")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (key, title, scale) in zip(axes[0], panels):
        by_div: dict[str, list[dict]] = defaultdict(list)
        for r in rows:
            if r.get(key) is None:
                continue
            se = r.get(key + "_se")
            err = None if se is None else scale * se
            if r["method"] == "ar":
                ax.errorbar(speed_of(r), scale * r[key], yerr=err, fmt="*", ms=14, color="black",
                            label="AR", zorder=5)
            elif r["method"] == "eagle2":
                ax.errorbar(speed_of(r), scale * r[key], yerr=err, fmt="D", ms=9, color="tab:red",
                            label=exact, zorder=5)
            else:
                by_div[r["divergence"]].append(r)
        for div, rs in sorted(by_div.items()):
            rs.sort(key=lambda r: threshold_from_json(r["threshold"]))
            xs = [speed_of(r) for r in rs]
            ys = [scale * r[key] for r in rs]
            errs = [scale * (r.get(key + "_se") or 0.0) for r in rs]
            ax.errorbar(xs, ys, yerr=errs, fmt="o-", ms=5, capsize=2, label=f"FSD {div}")
            for x, y, r in zip(xs, ys, rs):
                ax.annotate(format_threshold(threshold_from_json(r["threshold"])), (x, y), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))
        ax.set_xlabel("tokens / s (" + ("one single-process run" if single else "the sweep's own") + ")")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    meta = results.get("meta", {})
    source = rows[0].get("speed_source") if single and rows else concurrent_source(meta)
    fig.suptitle(f"{meta.get('settings', {}).get('target', '')} on {meta.get('device', '')}\nspeed: {source}",
                 fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
