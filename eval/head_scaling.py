"""The draft head's scaling study: tau against training data, training steps and head capacity, one point
per trained head, with the stop rule's verdict per axis.

    python -m eval head-scaling add --name data-2x --axis data --loss-tokens 28.0e6 --steps 5000 \\
        --gpu-seconds 1500 --mt-bench tau_mt.json [--spec-bench tau_sb.json] --recipe RECIPE.json \\
        --device "NVIDIA H200" --code abc1234 --command "eval/device/head.sh ..." [--mix own]
    python -m eval head-scaling spec-bench --name data-2x tau_sb.json   # measured apart from the training run
    python -m eval head-scaling attempt --axis steps --gpu-seconds 780 --why "the host was taken back"  # no point
    python -m eval head-scaling candidate --name warm-2k --mt-bench tau_mt.json --shipped-mt-bench tau_shipped.json \\
        [--sampled tau_mt_t07.json --shipped-sampled tau_shipped_t07.json] [--spec-bench ... --shipped-spec-bench ...]
    python -m eval head-scaling show
    python -m eval head-scaling draw    # the figure again, e.g. after a change to how it is drawn

``add`` and ``candidate`` also redraw the study's figure (``docs/figures/head_scaling.svg``: tau against loss
tokens and against training steps, capacity points beside their baselines, the shipped head's tau as a line).

A point is one head: the axis it belongs to (``data``: loss tokens at a fixed number of steps, ``steps``: training
steps at fixed data, ``capacity``: a larger head at equal training compute, named against its ``--baseline``
point), its size figures and its tau on MT-bench (and Spec-Bench, by category), as ``python -m eval tau``
writes them. A point's ``mix`` says what its answers were (``MIXES``: the recipe's data, or the target's own
answers only); an axis compares points of one mix, with a verdict for each, since a head trained on fewer tokens
of the target's own answers can beat one trained on more tokens that add other text (a baseline must be of its
point's mix). ``add`` writes or replaces the point of that name in the study's file
(``eval/results/head_scaling.json``, rewritten whole and atomically) and recomputes the verdicts.

The stop rule: along an axis, points are ordered by the axis' quantity; each step between neighbours is
converted to a gain per doubling, ``(tau_b / tau_a) ** (1 / log2(x_b / x_a)) - 1``; when the last step's gain
per doubling is under ``STOP_GAIN`` (2 %), that axis stops. An axis also stops once it has spent
``AXIS_GPU_LIMIT_S`` (3 hours) of GPU time in all: its own points' ``gpu_seconds`` plus the runs of that axis
that made no point (``attempt``: a host taken back, a run stopped). A capacity point helps when its tau beats
its baseline's by at least ``STOP_GAIN``.

A candidate is a head trained to replace the shipped one rather than to place a point (a warm start from the
shipped head, say), set against the shipped head's tau measured on the same device with the same settings
(``candidate`` refuses a pair measured on two devices, at two temperatures or with two trees, a greedy
MT-bench result that was sampled and a sampled one that was greedy). It beats the shipped head's tau
when its greedy MT-bench tau is higher by at least ``STOP_GAIN`` and no other pair it gives (sampled MT-bench,
Spec-Bench) is lower by that much; only then is the speed run against the shipped head worth its GPU time, and
the head ships if that run agrees.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

from fsd_eagle.errors import InputError
from fsd_eagle.jsonl import write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = ROOT / "eval" / "results" / "head_scaling.json"
DEFAULT_FIGURE = ROOT / "docs" / "figures" / "head_scaling.svg"
STOP_GAIN = 0.02
AXIS_GPU_LIMIT_S = 3 * 3600
AXES = {"data": "loss_tokens", "steps": "steps", "capacity": None}  # axis -> the quantity it orders points by
# What a head was trained on (a point's "mix"): an axis compares points of one mix only, since tau depends on
# what the answers are, not only on how many tokens they hold.
MIXES = {"recipe": "the recipe's data: the target's own answers plus the conversations' original answers",
         "own": "the target's own answers only (python -m training run --answers distilled)"}
DEFAULT_MIX = "recipe"  # a point without a mix (written before mixes were named) was trained on the recipe's data
WHAT = ("The draft head's scaling study for the default model: MT-bench tau (80 first turns, greedy) and Spec-Bench "
        "tau per category of heads trained with one recipe each, against loss tokens at a fixed number of steps (data), "
        "training steps at fixed data (steps) and head capacity at equal training compute (capacity); a point's mix "
        "says what its answers were (recipe: the target's answers plus the original ones; own: the target's answers "
        "only), and an axis compares points of one mix. Stop rule: an axis stops when its last doubling adds less "
        "than 2 % tau, or when it has spent 3 hours of GPU time in all (its points of every mix and its attempts, "
        "runs that made no point). Candidates are heads trained to replace the shipped head, each against the shipped "
        "head's tau measured alike.")


def per_doubling(x_a: float, tau_a: float, x_b: float, tau_b: float) -> float:
    """The tau gain per doubling of the axis' quantity from point a to point b (x_b > x_a > 0)."""
    if not (x_b > x_a > 0 and tau_a > 0 and tau_b > 0):
        raise ValueError(f"per_doubling needs x_b > x_a > 0 and positive tau, got {x_a}, {x_b}, {tau_a}, {tau_b}")
    return (tau_b / tau_a) ** (1 / math.log2(x_b / x_a)) - 1


def axis_verdict(points: list[dict], key: str) -> dict:
    """Steps between neighbouring points of one axis (ordered by ``key``), each with its gain per doubling,
    and the verdict: "stop" when the last gain per doubling is under STOP_GAIN, "continue" otherwise,
    "needs two points" with fewer."""
    ordered = sorted(points, key=lambda p: p[key])
    steps = [{"from": a["name"], "to": b["name"], "ratio": round(b[key] / a[key], 3),
              "tau_gain": round(b["mt_bench_tau"] / a["mt_bench_tau"] - 1, 4),
              "gain_per_doubling": round(per_doubling(a[key], a["mt_bench_tau"], b[key], b["mt_bench_tau"]), 4)}
             for a, b in zip(ordered, ordered[1:]) if b[key] > a[key]]
    if not steps:
        return {"steps": [], "verdict": "needs two points"}
    last = steps[-1]["gain_per_doubling"]
    verdict = "stop" if last < STOP_GAIN else "continue"
    why = (f"the last doubling ({steps[-1]['from']} -> {steps[-1]['to']}) added {100 * last:.1f} % tau per doubling, "
           f"{'under' if verdict == 'stop' else 'at least'} {100 * STOP_GAIN:g} %")
    return {"steps": steps, "verdict": verdict, "why": why}


def capacity_verdicts(points: list[dict]) -> list[dict]:
    """Each capacity point against its baseline: the tau gain and whether it helps (at least STOP_GAIN)."""
    by_name = {p["name"]: p for p in points}
    out = []
    for p in points:
        if p["axis"] != "capacity":
            continue
        base = by_name.get(p.get("baseline"))
        if base is None:
            out.append({"name": p["name"], "verdict": f"baseline {p.get('baseline')!r} not in the study yet"})
            continue
        gain = p["mt_bench_tau"] / base["mt_bench_tau"] - 1
        out.append({"name": p["name"], "baseline": base["name"], "tau_gain": round(gain, 4),
                    "verdict": "helps" if gain >= STOP_GAIN else "does not help"})
    return out


def mix_of(point: dict) -> str:
    """What the point's head was trained on (a key of MIXES)."""
    return point.get("mix", DEFAULT_MIX)


def axis_points(points: list[dict], axis: str, mix: str = DEFAULT_MIX) -> list[dict]:
    """The points of one mix along ``axis``: its own and the baselines they name (a data point's baseline is
    the point of the same steps and mix that a steps run measured; a steps point's, that of the same data)."""
    mine = [p for p in points if p["axis"] == axis and mix_of(p) == mix]
    by_name = {p["name"]: p for p in points}
    bases = {p.get("baseline") for p in mine} - {None} - {p["name"] for p in mine}
    return mine + [by_name[name] for name in sorted(bases) if name in by_name]


def gpu_seconds_by_axis(points: list[dict], attempts: list[dict]) -> dict[str, float]:
    """GPU seconds each axis has spent: its own points' (not the baselines it borrows) and its attempts'."""
    spent = {axis: 0.0 for axis in AXES}
    for run in [*points, *attempts]:
        spent[run["axis"]] += run.get("gpu_seconds") or 0.0
    return {axis: round(s, 1) for axis, s in spent.items()}


def verdict_key(axis: str, mix: str) -> str:
    """Where an axis' verdict for one mix is kept in the study's verdicts: the axis' name for the recipe's
    data, ``axis:mix`` for another mix."""
    return axis if mix == DEFAULT_MIX else f"{axis}:{mix}"


def verdicts(points: list[dict], attempts: list[dict] = ()) -> dict:
    """The stop rule's verdict per axis and mix (the recipe's data always, another mix once the axis has a
    point of it): the gain rule's, or "stop" once the axis has spent its GPU time, over all its mixes."""
    spent = gpu_seconds_by_axis(points, list(attempts))
    result = {}
    for axis, key in AXES.items():
        if not key:
            continue
        mixes = [DEFAULT_MIX] + sorted({mix_of(p) for p in points if p["axis"] == axis} - {DEFAULT_MIX})
        for mix in mixes:
            v = {**axis_verdict(axis_points(points, axis, mix), key), "mix": mix, "gpu_seconds": spent[axis]}
            if spent[axis] >= AXIS_GPU_LIMIT_S and v["verdict"] != "stop":
                v["verdict"] = "stop"
                v["why"] = (f"{spent[axis] / 3600:.1f} h of GPU time spent, the most an axis gets "
                            f"({AXIS_GPU_LIMIT_S / 3600:g} h)")
            result[verdict_key(axis, mix)] = v
    result["capacity"] = capacity_verdicts(points)
    return result


def read_result(path: Path) -> dict:
    """A ``python -m eval tau`` result: {"tau": {"all": ..., category: ...}, "questions": ..., "run": ...},
    its tau values as floats."""
    try:
        data = json.loads(Path(path).read_text())
        tau = data["tau"]
        if not isinstance(tau, dict) or not isinstance(tau.get("all"), (int, float)):
            raise KeyError("tau.all")
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the tau result {path}: {e}") from None
    except (KeyError, TypeError):
        raise InputError(f"{path} is not a result of 'python -m eval tau' (no tau.all)") from None
    try:
        data["tau"] = {k: float(v) for k, v in tau.items()}
    except (TypeError, ValueError):
        raise InputError(f"{path}: a tau value is not a number") from None
    bad = {k: v for k, v in data["tau"].items() if not (math.isfinite(v) and v >= 1)}
    if bad:  # tau counts the tokens a round commits: at least the target's own one
        raise InputError(f"{path}: tau {bad} is not a tau (at least 1)")
    return data


def read_tau(path: Path) -> dict:
    """The tau of a ``python -m eval tau`` result, overall ("all") and per category."""
    return read_result(path)["tau"]


def spec_bench_fields(path: Path) -> dict:
    """A point's Spec-Bench fields from a ``python -m eval tau`` result: tau overall and per category, how many
    questions it decoded (a ``--per-category`` subset decodes fewer than the 480) and how it ran (device,
    dtype, date, code, command, versions: its ``run`` record), which may differ from the point's training run."""
    data = read_result(path)
    tau = data["tau"]
    fields = {"spec_bench_tau": tau["all"], "spec_bench_by_category": {k: v for k, v in tau.items() if k != "all"}}
    questions = data.get("questions")
    if isinstance(questions, dict) and isinstance(questions.get("all"), int):
        fields["spec_bench_questions"] = questions["all"]
    if isinstance(data.get("run"), dict):
        fields["spec_bench_run"] = data["run"]
    return fields


def attach_spec_bench(study: dict, name: str, path: Path) -> dict:
    """The study with the Spec-Bench fields of ``path`` written into its point ``name`` (replacing any)."""
    if not any(p["name"] == name for p in study["points"]):
        known = ", ".join(p["name"] for p in study["points"]) or "none"
        raise InputError(f"the study has no point named {name!r} (points: {known})")
    fields = spec_bench_fields(path)
    study["points"] = [{**{k: v for k, v in p.items() if not k.startswith("spec_bench")}, **fields}
                       if p["name"] == name else p for p in study["points"]]
    return study


def load_study(path: Path) -> dict:
    if not path.exists():
        return {"what": WHAT, "stop_gain": STOP_GAIN, "points": [], "attempts": []}
    try:
        study = json.loads(path.read_text())
        if not isinstance(study, dict) or not isinstance(study.get("points"), list):
            raise ValueError("no points list")
        if not isinstance(study.setdefault("attempts", []), list):
            raise ValueError("attempts is not a list")
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is not a head-scaling study: {e}") from None
    return study


def positive(name: str, value: float | None, integer: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value <= 0 or (integer and value != int(value)):
        raise InputError(f"--{name} must be a {'whole ' if integer else ''}number > 0, got {value}")


def check_baseline(args: argparse.Namespace, by_name: dict[str, dict]) -> None:
    """A named baseline is in the study, was trained on the same mix and, for a data or steps point, holds the
    quantity fixed along that axis (a data point's baseline has its steps, a steps point's its loss tokens):
    InputError otherwise."""
    if not args.baseline:
        return
    base = by_name.get(args.baseline)
    if base is None or args.baseline == args.name:
        raise InputError(f"--baseline {args.baseline!r} is not another point of the study")
    if mix_of(base) != args.mix:
        raise InputError(f"a point's baseline must be of its mix ({args.mix}); {base['name']} is of {mix_of(base)}")
    fixed = {"data": "steps", "steps": "loss_tokens"}.get(args.axis)
    if fixed and base.get(fixed) != getattr(args, fixed):
        raise InputError(f"a {args.axis} point's baseline must have its {fixed.replace('_', ' ')} "
                         f"({getattr(args, fixed)}); {base['name']} has {base.get(fixed)}")


def add(args: argparse.Namespace) -> dict:
    """The study with ``args``' point written (replacing one of the same name), verdicts recomputed."""
    for name, integer in (("loss-tokens", False), ("steps", True), ("gpu-seconds", False), ("parameters", True)):
        positive(name, getattr(args, name.replace("-", "_")), integer)
    for axis, key in AXES.items():
        if args.axis == axis and key and getattr(args, key) is None:
            raise InputError(f"a {axis} point needs --{key.replace('_', '-')}")
    if args.axis == "capacity" and not args.baseline:
        raise InputError("a capacity point needs --baseline (the point of equal training compute it is compared with)")
    study = load_study(args.file)
    check_baseline(args, {p["name"]: p for p in study["points"]})
    mt = read_tau(args.mt_bench)
    point = {"name": args.name, "axis": args.axis, "mix": args.mix, "loss_tokens": args.loss_tokens,
             "steps": args.steps, "gpu_seconds": args.gpu_seconds, "parameters": args.parameters,
             "baseline": args.baseline,
             "mt_bench_tau": mt["all"], "mt_bench_by_category": {k: v for k, v in mt.items() if k != "all"},
             "recipe": args.recipe, "device": args.device, "date": args.date, "code": args.code,
             "command": args.command, "note": args.note}
    if args.spec_bench:
        point.update(spec_bench_fields(args.spec_bench))
    point = {k: v for k, v in point.items() if v is not None}
    study["points"] = [p for p in study["points"] if p["name"] != args.name] + [point]
    return with_verdicts(study)


def with_verdicts(study: dict) -> dict:
    """The study with its description, rule constants and verdicts as this code computes them."""
    study.update(what=WHAT, stop_gain=STOP_GAIN, axis_gpu_limit_s=AXIS_GPU_LIMIT_S)
    study["verdicts"] = verdicts(study["points"], study["attempts"])
    return study


def add_attempt(args: argparse.Namespace) -> dict:
    """The study with a run that made no point recorded on its axis (its GPU time counts towards the axis'
    limit), verdicts recomputed."""
    positive("gpu-seconds", args.gpu_seconds)
    if not args.why.strip():
        raise InputError("--why must say why the run made no point")
    study = load_study(args.file)
    attempt = {"axis": args.axis, "gpu_seconds": args.gpu_seconds, "why": args.why, "device": args.device,
               "date": args.date, "code": args.code, "command": args.command}
    study["attempts"].append({k: v for k, v in attempt.items() if v is not None})
    return with_verdicts(study)


# A candidate's tau pairs: the option naming its result, the shipped head's, the pair's name in the study, and
# whether its results must be sampled (True), greedy (False) or either (None).
CANDIDATE_PAIRS = (("mt_bench", "shipped_mt_bench", "MT-bench", False),
                   ("sampled", "shipped_sampled", "MT-bench sampled", True),
                   ("spec_bench", "shipped_spec_bench", "Spec-Bench", None))


def tau_pair(mine: Path, shipped: Path, what: str) -> dict:
    """A candidate's tau and the shipped head's on one benchmark, with the relative gain, from two ``python -m
    eval tau`` results measured alike (the same device, temperature and tree, where their records say):
    InputError otherwise."""
    a, b = read_result(mine), read_result(shipped)
    alike = {"device": lambda r: (r.get("run") or {}).get("device"), "temperature": lambda r: r.get("temperature"),
             "tree": lambda r: r.get("tree")}
    for key, of in alike.items():
        if of(a) != of(b):
            raise InputError(f"{what}: the candidate's tau and the shipped head's were measured with another {key} "
                             f"({of(a)} against {of(b)}); compare heads measured alike")
    tau, shipped_tau = a["tau"]["all"], b["tau"]["all"]
    return {"tau": tau, "shipped_tau": shipped_tau, "gain": round(tau / shipped_tau - 1, 4),
            "device": alike["device"](a), "temperature": a.get("temperature")}


def candidate_verdict(pairs: dict[str, dict]) -> str:
    """Whether a candidate beats the shipped head's tau (``STOP_GAIN`` more on greedy MT-bench, no other pair
    ``STOP_GAIN`` lower), and so whether the speed run against it comes next."""
    main_gain = pairs["MT-bench"]["gain"]
    worse = [f"{what} {pair['gain']:+.1%}" for what, pair in pairs.items() if pair["gain"] <= -STOP_GAIN]
    if main_gain >= STOP_GAIN and not worse:
        return (f"beats the shipped head's tau (MT-bench {main_gain:+.1%}): the speed run against it next "
                "(python -m eval speed --compare-head), and it ships if that run agrees")
    why = [f"MT-bench {main_gain:+.1%}, under {STOP_GAIN:.0%}"] if main_gain < STOP_GAIN else []
    return "does not beat the shipped head (" + "; ".join(why + worse) + ")"


def add_candidate(args: argparse.Namespace) -> dict:
    """The study with ``args``' candidate written (replacing one of the same name)."""
    positive("gpu-seconds", args.gpu_seconds)
    pairs = {}
    for mine, shipped, what, sampled in CANDIDATE_PAIRS:
        a, b = getattr(args, mine), getattr(args, shipped)
        if (a is None) != (b is None):
            raise InputError(f"--{mine.replace('_', '-')} and --{shipped.replace('_', '-')} go together: "
                             "a candidate's tau is compared with the shipped head's")
        if a is None:
            continue
        pair = pairs[what] = tau_pair(a, b, what)
        if sampled is not None and bool(pair["temperature"]) != sampled:
            raise InputError(f"the {what} results were measured at temperature {pair['temperature']}: "
                             + ("--sampled takes results of python -m eval tau --temperature T > 0" if sampled
                                else "--mt-bench takes greedy results (temperature 0)"))
    study = load_study(args.file)
    candidate = {"name": args.name, "tau": pairs, "verdict": candidate_verdict(pairs),
                 "gpu_seconds": args.gpu_seconds, "date": args.date, "code": args.code, "command": args.command,
                 "note": args.note}
    study["candidates"] = [c for c in study.get("candidates") or [] if c["name"] != args.name] + \
        [{k: v for k, v in candidate.items() if v is not None}]
    return with_verdicts(study)


def shipped_mt_bench(study: dict) -> float | None:
    """The shipped head's greedy MT-bench tau as the latest candidate measured it (None: no candidate)."""
    for candidate in reversed(study.get("candidates") or []):
        pair = candidate.get("tau", {}).get("MT-bench")
        if pair:
            return pair["shipped_tau"]
    return None


def plot(study: dict) -> str:
    """The study as SVG: MT-bench tau against loss tokens (data points) and against steps (steps points),
    base-2 x axes, one tau scale for both; each capacity point drawn on both panels where its baseline is, as
    its own series; where a candidate has measured the shipped head, its greedy MT-bench tau as a dashed line
    across both panels (how far the study's heads are from it)."""
    from .figures import COLORS, Panel, Series, svg

    points = study["points"]
    by_name = {p["name"]: p for p in points}
    shipped = shipped_mt_bench(study)
    taus = [p["mt_bench_tau"] for p in points] + ([shipped] if shipped is not None else [])
    shared = (min(taus), max(taus)) if taus else None  # one tau scale on both panels: gains compare by eye
    panels = []
    colors = {"recipe": COLORS["eagle2"], "own": COLORS["js"]}  # a mix added later: grey until it has a colour
    for axis, key, title in (("data", "loss_tokens", "loss tokens"), ("steps", "steps", "training steps")):
        series = []
        for mix in MIXES:
            mine = sorted((p for p in axis_points(points, axis, mix) if p.get(key)), key=lambda p: p[key])
            label = f"{axis} axis" if mix == DEFAULT_MIX else f"{axis} axis, {mix} answers"
            if mine:
                series.append(Series(label, colors.get(mix, COLORS["ar"]), [(p[key], p["mt_bench_tau"]) for p in mine],
                                     [p["name"] for p in mine]))
        for p in points:
            base = by_name.get(p.get("baseline")) if p["axis"] == "capacity" else None
            if base is not None and base["axis"] == axis and base.get(key):
                series.append(Series(p["name"], COLORS["fsd"], [(base[key], p["mt_bench_tau"])], [p["name"]]))
        if series and shipped is not None:
            xs = [x for one in series for x, _ in one.points]
            series.append(Series("shipped head", COLORS["ar"], [(min(xs), shipped), (max(xs), shipped)],
                                 ["", f"shipped head {shipped:.2f}"], dashed=True))
        if series:
            panels.append(Panel(f"tau against {title}", f"{title} (log scale)", "MT-bench tau (greedy)", series,
                                log_x=True, legend="upper left", y_range=shared))
    dates = sorted(p["date"] for p in points if p.get("date"))
    caption = [f"Draft heads for the default model: {len(points)} points"
               + (f", {dates[0]} to {dates[-1]}" if dates else "") + "; eval/results/head_scaling.json."]
    return svg(panels, caption) if panels else ""


def checked_figure(study: dict, path: Path) -> str | None:
    """The study's figure as SVG text for ``path`` (None: nothing to draw yet), checked before anything is
    written: a file there that this command did not draw is not replaced (InputError)."""
    from .figures import replaceable

    drawn = plot(study)
    if drawn and not replaceable(path):
        raise InputError(f"{path} exists and was not drawn by this command: not replaced (choose another --figure)")
    return drawn or None


def write_figure(path: Path, drawn: str) -> None:
    """Write a figure that ``checked_figure`` drew for ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, drawn)
    print(f"wrote {path}", file=sys.stderr)


def show(study: dict) -> str:
    lines = [f"{'point':<22} {'axis':<9} {'mix':<7} {'loss tokens':>12} {'steps':>7} {'GPU s':>7} "
             f"{'MT-bench tau':>13} {'Spec-Bench tau':>15}"]

    def cell(value, width: int) -> str:
        return f"{value:>{width},.0f}" if value is not None else f"{'-':>{width}}"

    for p in sorted(study["points"], key=lambda p: (p["axis"], p.get("loss_tokens") or 0, p.get("steps") or 0)):
        lines.append(f"{p['name']:<22} {p['axis']:<9} {mix_of(p):<7} {cell(p.get('loss_tokens'), 12)} "
                     f"{cell(p.get('steps'), 7)} {cell(p.get('gpu_seconds'), 7)} {p['mt_bench_tau']:>13.3f} "
                     + (f"{p['spec_bench_tau']:>15.3f}" if "spec_bench_tau" in p else f"{'-':>15}"))
    for key, v in (study.get("verdicts") or {}).items():
        if key == "capacity":
            lines += [f"capacity {c['name']}: {c['verdict']}" for c in v]
        else:
            spent = f"; {v['gpu_seconds'] / 3600:.2f} h of GPU time" if "gpu_seconds" in v else ""
            mix = v.get("mix", DEFAULT_MIX)
            axis = key.split(":")[0] + (f" ({mix} answers)" if mix != DEFAULT_MIX else "")
            lines.append(f"{axis}: {v['verdict']}" + (f" ({v['why']}{spent})" if "why" in v else ""))
    for run in study.get("attempts") or []:
        lines.append(f"attempt ({run['axis']}, {run['gpu_seconds']:,.0f} GPU s, no point): {run['why']}")
    for c in study.get("candidates") or []:
        pairs = "; ".join(f"{what} {pair['tau']:.3f} against {pair['shipped_tau']:.3f}"
                          for what, pair in c["tau"].items())
        lines.append(f"candidate {c['name']} ({pairs}): {c['verdict']}")
    return "\n".join(lines)


def add_record_options(p: argparse.ArgumentParser) -> None:
    """How a trained head was made and where it is written: the options of ``add`` and ``candidate``."""
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--code", help="the commit of the code that trained and measured it")
    p.add_argument("--command", help="the command that trained it")
    p.add_argument("--note")
    p.add_argument("--file", type=Path, default=DEFAULT_FILE)
    p.add_argument("--figure", type=Path, default=DEFAULT_FIGURE, help="the SVG figure redrawn from the study")


def parser() -> argparse.ArgumentParser:
    from fsd_eagle.cli import OneLineParser

    p = OneLineParser(prog="python -m eval head-scaling", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command_name", required=True)
    a = sub.add_parser("add", help="write one trained head's point into the study")
    a.add_argument("--name", required=True)
    a.add_argument("--axis", required=True, choices=list(AXES))
    a.add_argument("--loss-tokens", type=float, help="tokens the loss was taken over in training")
    a.add_argument("--steps", type=int, help="optimizer steps")
    a.add_argument("--gpu-seconds", type=float, help="GPU seconds of self-distillation and training")
    a.add_argument("--parameters", type=int, help="the head's trainable parameters")
    a.add_argument("--mix", choices=list(MIXES), default=DEFAULT_MIX,
                   help="what the head was trained on: " + "; ".join(f"{k}: {v}" for k, v in MIXES.items()))
    a.add_argument("--baseline", help="capacity: the point of equal training compute it is compared with; data "
                   "(steps): the point of the same steps (data) it extends, which then joins this axis")
    a.add_argument("--mt-bench", type=Path, required=True, help="python -m eval tau's result on MT-bench")
    a.add_argument("--spec-bench", type=Path, help="python -m eval tau's result on Spec-Bench")
    a.add_argument("--recipe", help="the training recipe (a file in training/recipes/)")
    a.add_argument("--device")
    add_record_options(a)
    b = sub.add_parser("spec-bench", help="write a point's Spec-Bench tau, measured apart from its training run")
    b.add_argument("--name", required=True, help="the point")
    b.add_argument("result", type=Path, help="python -m eval tau --questions spec_bench's result")
    b.add_argument("--file", type=Path, default=DEFAULT_FILE)
    t = sub.add_parser("attempt", help="record a run that made no point; its GPU time counts towards its axis")
    t.add_argument("--axis", required=True, choices=list(AXES))
    t.add_argument("--gpu-seconds", type=float, required=True, help="GPU seconds the run held")
    t.add_argument("--why", required=True, help="why it made no point")
    t.add_argument("--device")
    t.add_argument("--date", default=datetime.date.today().isoformat())
    t.add_argument("--code")
    t.add_argument("--command")
    t.add_argument("--file", type=Path, default=DEFAULT_FILE)
    c = sub.add_parser("candidate", help="record a head trained to replace the shipped one, against the shipped "
                       "head's tau measured alike")
    c.add_argument("--name", required=True)
    c.add_argument("--mt-bench", type=Path, required=True, help="python -m eval tau's result on MT-bench (greedy)")
    c.add_argument("--shipped-mt-bench", type=Path, required=True, help="the shipped head's, on the same device")
    c.add_argument("--sampled", type=Path, help="python -m eval tau --temperature T's result on MT-bench")
    c.add_argument("--shipped-sampled", type=Path, help="the shipped head's, at the same temperature and device")
    c.add_argument("--spec-bench", type=Path, help="python -m eval tau's result on Spec-Bench")
    c.add_argument("--shipped-spec-bench", type=Path, help="the shipped head's, on the same device")
    c.add_argument("--gpu-seconds", type=float, help="GPU seconds of its self-distillation and training")
    add_record_options(c)
    s = sub.add_parser("show", help="the study's points and verdicts")
    s.add_argument("--file", type=Path, default=DEFAULT_FILE)
    d = sub.add_parser("draw", help="redraw the study's figure from its file (add does this itself)")
    d.add_argument("--file", type=Path, default=DEFAULT_FILE)
    d.add_argument("--figure", type=Path, default=DEFAULT_FIGURE, help="the SVG figure redrawn from the study")
    return p


def save(study: dict, file: Path, figure: Path | None = None) -> None:
    """Write the study atomically, and redraw its figure into ``figure`` where one is given; a figure that may
    not be replaced is refused before the study is written, so that the two never disagree."""
    drawn = checked_figure(study, figure) if figure is not None else None
    write_text_atomic(file, json.dumps(study, indent=1) + "\n")
    if drawn is not None:
        write_figure(figure, drawn)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command_name == "add":
            study = add(args)
            save(study, args.file, args.figure)
        elif args.command_name == "attempt":
            study = add_attempt(args)
            save(study, args.file)
        elif args.command_name == "candidate":
            study = add_candidate(args)
            save(study, args.file, args.figure)  # the figure's line for the shipped head's tau
        elif args.command_name == "spec-bench":
            study = attach_spec_bench(load_study(args.file), args.name, args.result)
            save(study, args.file)
        elif args.command_name == "draw":
            study = load_study(args.file)
            drawn = checked_figure(study, args.figure)
            if drawn is not None:
                write_figure(args.figure, drawn)
        else:
            study = load_study(args.file)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(show(study))
    return 0


if __name__ == "__main__":
    sys.exit(main())
