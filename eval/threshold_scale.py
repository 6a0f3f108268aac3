"""What an FSD threshold T means for a target and its draft LM: the divergences at the answer positions where
the draft's top token differs from the target's, along answers the target wrote itself.

    python -m eval.threshold_scale --target DIR --draft-model DIR --records SWEEP/raw/ar \\
        [--tasks gsm8k arith] [--limit 25] [--thresholds reverse_kl:0.25,0.5,1,2,3,4 kl:1,2,4 js:0.2,0.4] \\
        [--device cpu] [--dtype float32] [--out FILE]

The answers are the greedy AR records of a sweep (``<records>/<task>.jsonl`` or ``.jsonl.gz``: each
record's ``token_ids`` after its question's prompt, asked as the sweep asks it). One forward of the target
and one of the draft LM over prompt + answer give p and q at every answer position (teacher forcing: the
decisions the first round of each position would take). Where argmax p != argmax q, exact greedy
verification rejects the draft's token and the hybrid FSD rule accepts it iff D(p, q) <= T. Reported per
task: the answer positions, how many have differing tops (and their share), quantiles of each divergence at
those positions, and for each threshold the share of them that FSD accepts. A threshold that accepts almost
none of them changes little; one that accepts almost all of them decodes nearly what the draft LM would.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
DEFAULT_THRESHOLDS = ("reverse_kl:0.25,0.5,1,2,3,4", "kl:1,2,4", "js:0.2,0.4")


def parse_pairs(items: list[str]) -> dict[str, list[float]]:
    """``DIVERGENCE:T1,T2,...`` items -> {divergence: [T, ...]} (names from fsd_eagle.divergence)."""
    from fsd_eagle.config import parse_threshold
    from fsd_eagle.divergence import DIVERGENCES
    from fsd_eagle.errors import InputError

    out: dict[str, list[float]] = {}
    for item in items:
        name, _, values = item.partition(":")
        if name not in DIVERGENCES or not values.strip():
            raise InputError(f"--thresholds takes DIVERGENCE:T1,T2,... with a divergence of {', '.join(DIVERGENCES)}; "
                             f"got {item!r}")
        out.setdefault(name, []).extend(parse_threshold(v) for v in values.split(",") if v.strip())
    return out


def read_records(records: Path, task: str, limit: int | None) -> list[dict]:
    """The first ``limit`` records of ``records/<task>.jsonl[.gz]`` (in file order)."""
    from fsd_eagle.errors import InputError

    for name in (f"{task}.jsonl", f"{task}.jsonl.gz"):
        path = records / name
        if path.is_file():
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            return rows[:limit] if limit else rows
    raise InputError(f"no records of {task} in {records} ({task}.jsonl or {task}.jsonl.gz)")


def teacher_forced(model, ids: list[int], start: int, device) -> torch.Tensor:
    """Float32 log-probs ``[n, V]`` of the tokens at positions ``start ..`` of ``ids`` (each from the tokens
    before it)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0, start - 1:-1]
    return logits.float().log_softmax(-1)


def scale(p: torch.Tensor, q: torch.Tensor, thresholds: dict[str, list[float]]) -> dict:
    """From target and draft log-probs ``[N, V]`` at N answer positions: counts, divergence quantiles where
    the tops differ, and the share of those accepted at each threshold."""
    from fsd_eagle.divergence import divergence

    differ = p.argmax(-1) != q.argmax(-1)
    out = {"positions": int(p.shape[0]), "tops_differ": int(differ.sum()),
           "share_differ": round(float(differ.double().mean()), 4) if p.shape[0] else None,
           "quantiles_where_tops_differ": {}, "accepted_share": {}}
    for name, values in thresholds.items():
        d = divergence(name, p[differ], q[differ]).double() if differ.any() else torch.empty(0, dtype=torch.double)
        out["quantiles_where_tops_differ"][name] = (
            {f"q{round(100 * x)}": round(float(d.quantile(x)), 4) for x in QUANTILES} if d.numel() else None)
        out["accepted_share"][name] = {
            f"{t:g}": (round(float((d <= t).double().mean()), 4) if d.numel() else None) for t in values}
    return out


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(ROOT))
    import transformers

    from eval.runinfo import git_commit
    from eval.sweep import load_questions
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.jsonl import write_text_atomic

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft-model", required=True)
    ap.add_argument("--records", required=True, help="folder of a sweep's AR records (OUT/raw/ar)")
    ap.add_argument("--tasks", nargs="+", default=["gsm8k", "arith"])
    ap.add_argument("--limit", type=int, default=25, help="answers per task, in file order")
    ap.add_argument("--thresholds", nargs="+", default=list(DEFAULT_THRESHOLDS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", help="JSON file to write (default: print only)")
    a = ap.parse_args(argv)
    thresholds = parse_pairs(a.thresholds)
    answers = {task: read_records(Path(a.records), task, a.limit) for task in a.tasks}  # bad input first
    gen = SpeculativeGenerator.load(a.target, draft_model=a.draft_model, device=a.device, dtype=a.dtype)
    target, draft = gen.engine.model, gen.engine.draft_model  # the stock models, loaded once
    tasks = {}
    for task, records in answers.items():
        prompts = {q.qid: q.prompt for q in load_questions(task)}
        ps, qs = [], []
        for r in records:
            prompt = list(gen.encode(prompts[str(r["qid"])]))
            ids = prompt + list(r["token_ids"])
            if len(ids) == len(prompt):
                continue
            ps.append(teacher_forced(target, ids, len(prompt), a.device))
            qs.append(teacher_forced(draft, ids, len(prompt), a.device))
        p = torch.cat(ps) if ps else torch.empty(0, 1)
        q = torch.cat(qs) if qs else torch.empty(0, 1)
        tasks[task] = {"answers": len(records), **scale(p, q, thresholds)}
    result = {
        "what": "divergences between the target and its draft LM where their top tokens differ, teacher-forced "
                "along the target's own greedy answers (eval/threshold_scale.py)",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": a.device, "dtype": a.dtype, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "commit": git_commit(short=True) or "unknown",
        "command": "python -m eval.threshold_scale " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": a.target, "draft_model": a.draft_model, "records": a.records, "tasks": tasks,
    }
    if a.out:
        write_text_atomic(Path(a.out), json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    from fsd_eagle.errors import FSDError

    try:
        main()
    except FSDError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
