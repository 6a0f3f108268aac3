"""Acceptance length tau per category: decoding of each question's first turn with the default tree, greedy
(temperature 0) or sampled (question i of the list with seed ``seed + i``, so a rerun samples the same texts),
in several worker processes sharing one device (a batch-1 loop leaves a GPU idle).

    python -m eval tau --questions mt_bench --max-new-tokens 128 --workers 8 [--temperature 0.7]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections import defaultdict


def _worker(args) -> list[dict]:
    rank, jobs, opts = args
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import TreeConfig

    gen = SpeculativeGenerator.load(target=opts["target"], head=opts["head"], draft_model=opts["draft_model"],
                                    device=opts["device"], dtype=opts["dtype"], tree=TreeConfig(**opts["tree"]),
                                    threads=1)
    rows = []
    temperature = opts["temperature"]
    for index, qid, category, prompt in jobs:
        seed = opts["seed"] + index if temperature else None
        r = gen.generate(prompt, opts["max_new_tokens"], temperature=temperature, seed=seed)
        row = {"question_id": qid, "category": category, "new_tokens": r.stats.new_tokens,
               "target_forwards": r.stats.target_forwards}
        if opts["exact"]:
            ar = gen.generate(prompt, opts["max_new_tokens"], autoregressive=True).token_ids
            row["identical"] = r.token_ids == ar
            if not row["identical"]:
                row["first_difference"] = next((i for i, (a, b) in enumerate(zip(r.token_ids, ar)) if a != b),
                                               min(len(r.token_ids), len(ar)))
        rows.append(row)
    return rows


def measure_tau(questions, target=None, head=None, device=None, dtype=None, max_new_tokens=128, workers=1,
                tree=None, temperature: float = 0.0, seed: int = 0, draft_model=None, exact: bool = False) -> dict:
    """tau = total new tokens / total target forwards, overall and per category; greedy, or sampled at
    ``temperature`` (question i with seed ``seed + i``, whichever worker decodes it). The drafter is ``head``
    (default: the head shipped for the target) or a ``draft_model`` folder (classic SD), named in the
    result. ``exact`` (greedy only): also decode every question autoregressively and count the answers whose
    tokens are identical (``identical_to_ar`` per category, and the question ids and first differing
    position of any that are not)."""
    if exact and temperature:
        raise ValueError("exact compares greedy decoding with autoregressive decoding: temperature must be 0")
    jobs = [(i, q.question_id, q.category, q.turns[0]) for i, q in enumerate(questions)]
    opts = {"target": target, "head": head, "draft_model": draft_model, "device": device, "dtype": dtype,
            "max_new_tokens": max_new_tokens, "tree": tree or {}, "temperature": temperature, "seed": seed,
            "exact": exact}
    chunks = [(i, jobs[i::workers], opts) for i in range(workers)]
    start = time.perf_counter()
    if workers == 1:
        rows = _worker(chunks[0])
    else:
        with mp.get_context("spawn").Pool(workers) as pool:
            rows = [r for part in pool.map(_worker, chunks) for r in part]
    per = defaultdict(lambda: [0, 0, 0, 0])  # new tokens, target forwards, questions, answers identical to AR
    for r in rows:
        for key in ("all", r["category"]):
            per[key][0] += r["new_tokens"]
            per[key][1] += r["target_forwards"]
            per[key][2] += 1
            per[key][3] += r.get("identical", False)
    drafter = ({"draft_model": str(draft_model)} if draft_model is not None
               else {"head": str(head) if head is not None else "shipped"})
    checked = {}
    if exact:
        checked = {"identical_to_ar": {k: v[3] for k, v in per.items()},
                   "differing": [{"question_id": r["question_id"], "first_difference": r["first_difference"]}
                                 for r in rows if not r["identical"]]}
    return {"tau": {k: round(v[0] / v[1], 3) for k, v in per.items()}, "tree": opts["tree"], **drafter,
            "questions": {k: v[2] for k, v in per.items()}, "temperature": temperature,
            **({"seed": seed} if temperature else {}), **checked, "seconds": round(time.perf_counter() - start, 1)}

