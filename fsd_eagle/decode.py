"""The decoding loop: prompt -> prefill -> draft tree -> verify (acceptance rule) -> commit -> repeat.

One host sync per round (reading the accepted tokens to detokenize and check stop conditions).
Plain autoregressive decoding is the same loop with no drafter: the tree is the root alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .config import TreeConfig
from .drafter import DraftRoot, SlotDrafter
from .sampling import choose
from .target import Target
from .tree import DraftTree, draft_tree, root_tree
from .verify import AcceptanceRule, Verdict, verify_tree


@dataclass
class DecodeStats:
    """Per-call statistics. tau = new tokens / target forwards (the prefill counts as one forward)."""

    new_tokens: int = 0
    target_forwards: int = 0
    fuzzy_accepted: int = 0
    divergence_sum: float = 0.0
    divergence_count: int = 0
    elapsed_s: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def divergence_mean(self) -> float | None:
        return self.divergence_sum / self.divergence_count if self.divergence_count else None


def plan_cache(prompt_len: int, max_new_tokens: int, tree: TreeConfig) -> int:
    """Slots a call needs: prompt, output, and one round's tree plus its padded accepted path."""
    return prompt_len + max_new_tokens + tree.total_tokens + tree.depth + 2


def decode(target: Target, drafter: SlotDrafter | None, prompt_ids: torch.Tensor, max_new_tokens: int,
           tree_cfg: TreeConfig, rule: AcceptanceRule, generator: torch.Generator | None,
           stats: DecodeStats) -> Iterator[list[int]]:
    """Yield the new token ids of each round (the caller stops iterating on EOS / stop strings).

    prompt_ids ``[L]`` on the target's device. ``stats`` is filled as rounds complete; at most
    ``max_new_tokens`` ids are yielded in total.
    """
    if max_new_tokens < 1:  # the prefill would already produce one token
        return
    drafting = drafter is not None and tree_cfg.drafts
    start = time.perf_counter()
    max_len = plan_cache(prompt_ids.shape[0], max_new_tokens, tree_cfg)
    target.allocate(max_len)
    features = target.prefill(prompt_ids)
    root_token = choose(target.logits(features[-1:])[0], rule.sampling, generator)
    root: DraftRoot | None = None
    if drafting:
        drafter.allocate(max_len, tree_cfg)
        root = drafter.prefill(torch.cat([prompt_ids, root_token[None]]), features)
    stats.target_forwards += 1
    produced = 1
    stats.new_tokens += 1
    stats.elapsed_s = time.perf_counter() - start
    yield [int(root_token)]
    while produced < max_new_tokens:
        tree = draft_tree(drafter, root_token, root.logits, root.state, tree_cfg) if drafting else root_tree(root_token)
        features = target.forward_tree(tree.tokens, tree.depths, tree.anc)
        verdict = verify_tree(tree, target.logits(features), rule, generator)
        target.commit(verdict.path, verdict.n_accepted)
        next_tokens = _next_tokens(tree, verdict)
        if drafting:
            root = drafter.commit(next_tokens, features[verdict.path], verdict.n_accepted)
        root_token = verdict.bonus
        # The round's only host sync: counters and tokens in one transfer (ids are exact in float64).
        meta = torch.stack([verdict.n_accepted, verdict.fuzzy_extra, verdict.div_count]).double()
        host = torch.cat([meta, verdict.div_sum.double()[None], next_tokens.double()]).tolist()
        n_acc, fuzzy_extra, div_count, div_sum = int(host[0]), int(host[1]), int(host[2]), host[3]
        new = [int(t) for t in host[4: 4 + n_acc]][: max_new_tokens - produced]
        produced += len(new)
        stats.target_forwards += 1
        stats.new_tokens += len(new)
        stats.fuzzy_accepted += fuzzy_extra
        stats.divergence_count += div_count
        stats.divergence_sum += div_sum
        stats.accept_lengths.append(n_acc)
        stats.elapsed_s = time.perf_counter() - start
        yield new


def _next_tokens(tree: DraftTree, verdict: Verdict) -> torch.Tensor:
    """``[P]``: the token after each accepted path node (the next accepted draft, then the bonus)."""
    nxt = torch.cat([tree.tokens[verdict.path[1:]], verdict.bonus[None]])
    return nxt.scatter(0, (verdict.n_accepted - 1)[None], verdict.bonus[None])
