"""How ``js_legacy`` relates to ``reverse_kl`` and to true JS on real target/draft distributions.

    python -m eval.divergence_compare            (from the repository root)
    python eval/divergence_compare.py [--prompts 4] [--pairs 200] [--out eval/results/divergence_compare.json]

Loads the default target and its shipped head on the CPU in float32 and decodes MT-bench first-turn
prompts greedily (exact EAGLE-2, so the tokens are the target's greedy tokens). The pairs (p, q) are
collected at the root of every round, with the same steps as ``fsd_eagle.decode.run_round``, on the
one-row session a greedy call uses (``gen.session()``; batch row 0 of every tensor):

- q = ``session.state.root_logits`` before the round: the head's draft logits for the token after the
  round's root token (the tree is set with ``draft_vocab=0``, so q covers every token);
- p = the target's logits at the tree's root node (node 0 of ``target.logits(target.forward_tree(...))``),
  i.e. the target's distribution for that same next token.

One pair per round, until ``--pairs`` pairs are collected. For each pair every name in
``fsd_eagle.divergence.DIVERGENCES`` is computed with ``fsd_eagle.divergence.divergence`` (full vocabulary,
no support truncation), and the relation between ``js_legacy``, ``reverse_kl`` and ``js`` is summarized.
Results: ``eval/results/divergence_compare.json`` (see docs/divergences.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

from fsd_eagle.jsonl import write_text_atomic

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "eval" / "results" / "divergence_compare.json"


def collect_pairs(gen, prompts: list[str], n_pairs: int, max_new_tokens: int = 512
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy exact decoding of each prompt in turn; returns target and draft logits ``[N, V]`` (float32,
    N <= n_pairs), one row per round (see the module docstring)."""
    from fsd_eagle.config import FuzzyConfig, SamplingConfig
    from fsd_eagle.decode import commit_round, plan_cache
    from fsd_eagle.tree import draft_tree
    from fsd_eagle.verify import AcceptanceRule, verify_tree

    session = gen.session()
    target, drafter, tree_cfg, st = session.target, session.drafter, session.tree, session.state
    rule = AcceptanceRule(SamplingConfig(), FuzzyConfig())
    form = rule.form
    ps, qs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor(gen.encode(prompt), dtype=torch.long, device=target.device)
            session.allocate(plan_cache(session.prompt_slots(ids.shape[0]), max_new_tokens, tree_cfg))
            session.start(0, ids, rule, 0).read()
            produced = 1
            while produced < max_new_tokens and len(ps) < n_pairs:
                q = st.root_logits[0].float().clone()
                tree = draft_tree(drafter, st.root_token, st.root_logits, st.root_state, tree_cfg, with_q=False)
                features = target.forward_tree(tree.tokens, tree.depths, tree.anc)
                logits = target.logits(features)
                ps.append(logits[0, 0].float().clone())
                qs.append(q)
                verdict = verify_tree(tree, logits, form, st.values, st.rng)
                new = commit_round(target, drafter, st, tree, features, verdict)
                n = int(verdict.n_accepted[0])
                produced += n
                if any(int(t) in gen.eos_ids for t in new[0, :n]):
                    break
            if len(ps) >= n_pairs:
                break
    return torch.stack(ps), torch.stack(qs)


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double() - a.double().mean(), b.double() - b.double().mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def summarize(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict:
    """Every divergence per pair, and the js_legacy / reverse_kl / js relation."""
    from fsd_eagle.divergence import DIVERGENCES, divergence

    d = {name: divergence(name, p_logits, q_logits).double() for name in DIVERGENCES}
    leg, rkl, js = d["js_legacy"], d["reverse_kl"], d["js"]
    pos = rkl > 1e-6
    ratio = leg[pos] / rkl[pos]
    ln2 = math.log(2.0)

    def stats(x: torch.Tensor) -> dict:
        return {"mean": round(float(x.mean()), 6), "median": round(float(x.median()), 6),
                "min": round(float(x.min()), 6), "max": round(float(x.max()), 6)}

    return {
        "pairs": int(p_logits.shape[0]),
        "top1_agreement": round(float((p_logits.argmax(-1) == q_logits.argmax(-1)).double().mean()), 4),
        "divergences": {name: stats(v) for name, v in d.items()},
        "corr_js_legacy_reverse_kl": round(_corr(leg, rkl), 4),
        "corr_js_legacy_js": round(_corr(leg, js), 4),
        "corr_js_legacy_kl": round(_corr(leg, d["kl"]), 4),
        "median_ratio_js_legacy_over_reverse_kl": round(float(ratio.median()), 4),
        "ratio_js_legacy_over_reverse_kl_quartiles": [round(float(x), 4) for x in
                                                      ratio.quantile(torch.tensor([0.25, 0.75], dtype=ratio.dtype))],
        "median_ratio_js_legacy_over_js": round(float((leg[js > 1e-6] / js[js > 1e-6]).median()), 4),
        "max_abs_js_legacy_minus_reverse_kl": round(float((leg - rkl).abs().max()), 6),
        "max_abs_js_legacy_minus_js": round(float((leg - js).abs().max()), 6),
        "js_legacy_max": round(float(leg.max()), 6),
        "js_legacy_le_ln2_always": bool((leg <= ln2).all()),
        "js_legacy_pairs_above_ln2": int((leg > ln2).sum()),
        "pairs_with_reverse_kl_gt_1e-6": int(pos.sum()),
    }


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(ROOT))
    import transformers

    from eval.runinfo import git_commit
    from eval.tasks import load_mt_bench
    from fsd_eagle.api import SpeculativeGenerator

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4, help="MT-bench questions (first turns), in file order")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=512, help="per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    a = ap.parse_args(argv)

    start = time.perf_counter()
    gen = SpeculativeGenerator.load(device="cpu", dtype="float32", threads=a.threads)
    gen.set_tree(draft_vocab=0)  # q over every token
    questions = load_mt_bench(limit=a.prompts)
    # Spread the pairs over the prompts: each prompt contributes at most its share.
    p_all, q_all = [], []
    for i, qn in enumerate(questions):
        share = (a.pairs - sum(x.shape[0] for x in p_all)) // (len(questions) - i)
        p, q = collect_pairs(gen, [qn.turns[0]], share, a.max_new_tokens)
        p_all.append(p)
        q_all.append(q)
    result = {
        "what": "js_legacy vs reverse_kl vs js on target/draft next-token distributions at the root of each "
                "round of greedy exact decoding (see the docstring of eval/divergence_compare.py)",
        "date": datetime.date.today().isoformat(),
        "device": "CPU",
        "dtype": "float32",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": git_commit(short=True) or "unknown",
        "command": "python -m eval.divergence_compare " + " ".join(argv if argv is not None else sys.argv[1:]),
        "target": "default (SmolLM2-135M-Instruct) with its shipped head",
        "tree": dataclasses.asdict(gen.tree),
        "prompts": [qn.question_id for qn in questions],
        **summarize(torch.cat(p_all), torch.cat(q_all)),
        "seconds": round(time.perf_counter() - start, 1),
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
