"""Tau of draft trees replayed on the target's own answers, greedy or sampled: every tree on the same texts.

With the tree's top children and the exact rule, the round that starts at position t of the text it ends up
writing has accepted exactly the longest root path of its tree that the text's next tokens follow: a child
that the text continues with can only have been accepted as a draft (the bonus drawn after the children are
rejected has them all removed), and a next token that is no child is that bonus. The tree at t depends on the
text before t only. So the rounds, and tau, are a function of the text alone: whatever text speculative
decoding writes, replaying its trees on it gives its rounds exactly (``tests/test_integration.py`` checks this
against real sampled decodes). Speculative sampling writes the target's own samples, so this module samples
each question's answer once from the target alone (question i with seed ``seed + i``; temperature 0: greedy)
and replays every tree on those answers, as ``trees.tune`` replays greedy ones: each tree's tau is measured on
the same texts, so trees are compared without the spread between different texts (a sampled tau on 40
questions can get a 2 % difference backwards: ``eval/results/archive/gpu_tree_scores_h200_1af56b1.json``), and heads
too, run after run on the same seeds. No target forward over trees: the head drafts from the target's features
of one forward over each answer. Not covered: FSD, and children sampled from the drafter.

    python -m eval replay --trees 64/6/8,48/5/8 --temperature 0.7 --per-category 5
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Sequence

from fsd_eagle.config import TreeConfig
from trees.tune import Tuner, rounds, walk


def replay_answers(gen, questions, trees: Sequence[TreeConfig], temperature: float, top_p: float = 1.0,
                   seed: int = 0, max_new_tokens: int = 128) -> dict:
    """Tau (new tokens / target forwards, as DecodeStats counts them) of each tree, overall and per category,
    replayed on each question's first-turn answer sampled from the target at ``temperature`` (greedy at 0),
    and each tree's ``by_depth``: of the rounds whose first d - 1 drafts were accepted (``reached``), those
    that accepted a d-th (``accepted``), for d = 1 ... depth: where along its depth a tree stops paying
    (a round cut by the token limit is left out)."""
    tuner = Tuner(gen, log=lambda msg: None)
    sums: dict[TreeConfig, dict[str, list[int]]] = {t: defaultdict(lambda: [0, 0]) for t in trees}
    reached = {t: [0] * t.depth for t in trees}
    accepted = {t: [0] * t.depth for t in trees}
    start = time.perf_counter()
    for i, q in enumerate(questions):
        prompt = gen.encode(q.turns[0])
        answer = gen.generate(prompt, max_new_tokens, temperature=temperature, top_p=top_p,
                              seed=seed + i if temperature else None, autoregressive=True).token_ids
        features = tuner.continuation(prompt, answer)
        accepts = tuner.replay(prompt, answer, features, trees, {}, {})
        for cfg in trees:
            new, forwards = walk(accepts[cfg], len(answer))
            for key in ("all", q.category):
                sums[cfg][key][0] += new
                sums[cfg][key][1] += forwards
            made = rounds(accepts[cfg], len(answer))
            for n in made[:-1]:  # the last round may be cut by the limit
                for d in range(min(n, cfg.depth)):  # n - 1 drafts accepted: depths 1 ... n reached
                    reached[cfg][d] += 1
                    accepted[cfg][d] += d < n - 1
        so_far = ", ".join(f"{cfg.label} {sums[cfg]['all'][0] / sums[cfg]['all'][1]:.3f}" for cfg in trees)
        print(f"question {i + 1}/{len(questions)} ({time.perf_counter() - start:.0f} s): {so_far}", file=sys.stderr,
              flush=True)
    rows = [{"tree": cfg.label, "tau": {k: round(n / f, 4) for k, (n, f) in sums[cfg].items()},
             "new_tokens": {k: n for k, (n, _) in sums[cfg].items()},
             "target_forwards": {k: f for k, (_, f) in sums[cfg].items()},
             "by_depth": {"reached": reached[cfg], "accepted": accepted[cfg],
                          "acceptance": [round(a / r, 4) if r else None for a, r in zip(accepted[cfg], reached[cfg])]}}
            for cfg in trees]
    return {"rows": rows, "temperature": temperature, "top_p": top_p, **({"seed": seed} if temperature else {}),
            "questions": len(questions), "max_new_tokens": max_new_tokens,
            "seconds": round(time.perf_counter() - start, 1)}
