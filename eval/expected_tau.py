"""Expected acceptance of draft trees under sampling, computed instead of sampled.

With the exact sampling rule and a tree of top children (``fsd_eagle.verify``), the walk at node n tries its
children in turn and takes child x_j with probability p(x_j) / (1 - mass of the children rejected before it);
multiplied out, the walk moves to x_j with probability p_n(x_j), p_n being the target's distribution at n
after temperature / top-p / top-k. So node i is reached with probability R_i = prod p_parent(token) over the
edges of its root path, and a round accepts E = sum_{i > 0} R_i draft tokens in expectation.

``measure_expected_tau`` decodes each question once with the target alone, sampling at the temperature
(question i with seed ``seed + i``), then walks that answer one token at a time as decoding commits it: at
every position it drafts each tree, runs the target's verify forward over it and adds up E. ``1 + mean E``
over the positions estimates a tree's tau for sampled decoding with no noise from the verifier's draws, and
every tree (or head) is scored on the same positions. A sampled tau needs many more questions to separate
trees a few percent apart (``eval/results/gpu_tree_scores_h200_1af56b1.json``: a 40-question pair pointed
the wrong way). It covers the exact rule with top children (the default); not FSD or sampled children.

    python -m eval expected --trees 64/6/8,48/5/8 --temperature 0.7 --per-category 5
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Sequence

import torch

from fsd_eagle.config import SamplingConfig, TreeConfig
from fsd_eagle.sampling import process_logits
from fsd_eagle.tree import DraftTree, draft_tree
from fsd_eagle.verify import AcceptanceRule


def expected_accepted(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """Expected accepted draft tokens ``[B]`` of trees ``[B, n]`` whose nodes' target distributions are
    ``probs`` ``[B, n, V]`` (row i: p_i, the distribution of node i's children): sum over non-root nodes of
    the product of p_parent(token) along the node's root path."""
    b, n, v = probs.shape
    edge = probs.flatten(1).gather(1, tree.parents * v + tree.tokens)  # p_parent(i)(token_i), [B, n]
    is_root = torch.arange(n, device=probs.device) == 0
    log_edge = torch.where(is_root, 0.0, edge.double().clamp(min=1e-300).log())
    log_reach = (tree.anc.double() @ log_edge.unsqueeze(2)).squeeze(2)  # sum over the path's edges
    return torch.where(is_root, 0.0, log_reach.exp()).sum(1)


@torch.no_grad()
def walk_answer(gen, prompt_ids: Sequence[int], answer: Sequence[int], trees: Sequence[TreeConfig],
                rule: AcceptanceRule) -> dict[TreeConfig, list[float]]:
    """E of every tree at every position of ``answer`` (the target's own tokens after ``prompt_ids``): the
    root of position t is answer[t] (chosen by the target, not yet in its cache), as in a round that
    starts there. Uses the generator's target and drafter (their caches are re-allocated)."""
    target, drafter, dev = gen.target, gen.drafter, gen.target.device
    form, values = rule.form, rule.values(dev)
    p = torch.tensor(list(prompt_ids), device=dev)
    a = torch.tensor(list(answer), device=dev)
    room = len(prompt_ids) + len(answer) + max(t.total_tokens for t in trees) + 8
    target.allocate(room)
    features = target.prefill(p[None])  # [1, L, s]
    drafter.allocate(room, TreeConfig(total_tokens=2, depth=max(t.depth for t in trees),
                                      top_k=max(t.top_k for t in trees)))
    root = drafter.prefill(torch.cat([p, a[:1]])[None], features)
    keep_root = torch.zeros(1, 1, dtype=torch.long, device=dev)
    one = torch.ones(1, dtype=torch.long, device=dev)
    out: dict[TreeConfig, list[float]] = {t: [] for t in trees}
    for t in range(len(answer) - 1):
        for cfg in trees:
            tree = draft_tree(drafter, a[t: t + 1], root.logits, root.state, cfg)
            features = target.forward_tree(tree.tokens, tree.depths, tree.anc)  # [1, n, s]
            probs = process_logits(target.logits(features).float(), form, values).softmax(-1)
            out[cfg].append(float(expected_accepted(tree, probs)[0]))
        target.commit(keep_root, one)  # the root's KV (the same node 0 in every tree) joins the cache
        root = drafter.commit(a[None, t + 1: t + 2], features[:, :1], one)
    return out


def measure_expected_tau(gen, questions, trees: Sequence[TreeConfig], temperature: float, top_p: float = 1.0,
                         seed: int = 0, max_new_tokens: int = 128) -> dict:
    """Expected tau (1 + mean E over every position of every answer) of each tree, overall and per category,
    on answers sampled from the target at ``temperature`` (question i with seed ``seed + i``)."""
    rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
    sums: dict[TreeConfig, dict[str, list[float]]] = {t: defaultdict(lambda: [0.0, 0]) for t in trees}
    start = time.perf_counter()
    for i, q in enumerate(questions):
        result = gen.generate(q.turns[0], max_new_tokens, temperature=temperature, top_p=top_p, seed=seed + i,
                              autoregressive=True)
        prompt_ids = gen.encode(q.turns[0])
        walked = walk_answer(gen, prompt_ids, result.token_ids, trees, rule)
        for cfg, values in walked.items():
            for key in ("all", q.category):
                sums[cfg][key][0] += sum(values)
                sums[cfg][key][1] += len(values)
    rows = [{"tree": cfg.label,
             "expected_tau": {k: round(1 + s / n, 4) for k, (s, n) in sums[cfg].items() if n},
             "positions": {k: n for k, (_, n) in sums[cfg].items()}} for cfg in trees]
    return {"rows": rows, "temperature": temperature, "top_p": top_p, "seed": seed, "questions": len(questions),
            "max_new_tokens": max_new_tokens, "seconds": round(time.perf_counter() - start, 1)}
