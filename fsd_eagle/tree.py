"""EAGLE-2 dynamic draft tree (Li et al. 2024, Sec. 4): expansion by cumulative draft log-probability, then
reranking to the ``total_tokens`` best nodes. All shapes are fixed by the TreeConfig: no host syncs.

Node 0 is the root (the last token chosen by the target, not yet in the KV cache); nodes are ordered by
depth, and within a depth by descending score, so every parent precedes its children.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .config import TreeConfig
from .kernels import topk


@dataclass
class DraftTree:
    """A verified-in-one-forward token tree with n = total nodes (root included).

    tokens ``[n]``; parents ``[n]`` (root's parent is itself, 0); depths ``[n]`` (root 0); anc ``[n, n]`` bool,
    anc[i, j] = node j is an ancestor of i or i itself; scores ``[n]``: cumulative draft log-prob (root 0;
    normalised over the draft vocabulary); q_logits ``[R, V]``: the draft's logits over every token at each
    expanded node (its children's distribution q_n; None unless asked for); q_row ``[n]``: row of q_logits
    for a node, -1 where the node was never expanded.
    max_depth: static bound on any node's depth (accepted paths have at most max_depth + 1 nodes).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    anc: torch.Tensor
    scores: torch.Tensor
    q_logits: torch.Tensor | None
    q_row: torch.Tensor
    max_depth: int

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    """What tree drafting needs from a draft head or a draft model (see fsd_eagle.drafter). ``vocab``: the
    token ids ``[V_d]`` that its logits' columns stand for (None: every token)."""

    vocab: torch.Tensor | None

    def logits(self, states: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Draft logits of states ``[n, s]``: over ``vocab``, or over every token with ``full``."""
        ...

    def step(self, depth: int, tokens: torch.Tensor, states: torch.Tensor, rows_anc: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft one tree level: frontier tokens ``[k]`` at ``depth`` (1-based), their parents' states
        ``[k, s]``, and ``rows_anc [k, A]``: which draft rows (A = (depth_max - 1) * k, level-major) each
        frontier row sees (its ancestors and itself). Returns logits ``[k, V_d]`` and states ``[k, s]``."""
        ...


def root_tree(root_token: torch.Tensor) -> DraftTree:
    """The tree of plain autoregressive decoding: the root alone."""
    dev = root_token.device
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    return DraftTree(root_token.reshape(1), zero, zero, torch.ones(1, 1, dtype=torch.bool, device=dev),
                     torch.zeros(1, device=dev), None, zero - 1, 0)


def draft_tree(drafter: Drafter, root_token: torch.Tensor, root_logits: torch.Tensor, root_state: torch.Tensor,
               cfg: TreeConfig, with_q: bool = False) -> DraftTree:
    """Grow the EAGLE-2 tree from the root's draft logits ``[V_d]`` and state ``[s]``.

    Level 1 takes the top_k tokens of q_root; each later level expands the current frontier (top_k nodes),
    scores the top_k x top_k children by cumulative log-prob and keeps the global top_k as the next
    frontier. Finally the ``total_tokens - 1`` best candidates (a connected subtree) become the tree.
    ``with_q``: also return the draft's distributions over every token (q_logits; the fuzzy rule's q_n).
    """
    k, depth, dev, vocab = cfg.top_k, cfg.depth, root_logits.device, drafter.vocab
    score, tok = _top_logprobs(root_logits[None], k, vocab)
    score, tok = score[0], tok[0]
    cand_tok, cand_score, cand_parent, cand_depth = [tok], [score], [torch.full((k,), -1, device=dev)], [1]
    q_logits, q_states, q_cands = [root_logits.reshape(1, -1)], [root_state.reshape(1, -1)], []
    frontier = torch.arange(k, device=dev)  # candidate indices of the frontier
    states = root_state.reshape(1, -1).expand(k, -1)
    area = (depth - 1) * k
    rows_anc = torch.zeros(k, area, dtype=torch.bool, device=dev)
    eye = torch.eye(k, dtype=torch.bool, device=dev)
    offset = k
    for d in range(1, depth):
        rows_anc[:, (d - 1) * k: d * k] = eye
        logits, out_states = drafter.step(d, tok, states, rows_anc)
        q_logits.append(logits)
        q_states.append(out_states)
        q_cands.append(frontier)
        child_score, child_tok = _top_logprobs(logits, k, vocab)  # [k, k]
        cum = (score.unsqueeze(1) + child_score).flatten()
        child_tok = child_tok.flatten()
        cand_tok.append(child_tok)
        cand_score.append(cum)
        cand_parent.append(frontier.repeat_interleave(k))
        cand_depth.append(d + 1)
        if d < depth - 1:
            score, best = topk(cum[None], k)
            score, best = score[0], best[0]
            parent_row = best // k
            tok, frontier = child_tok[best], offset + best
            states, rows_anc = out_states[parent_row], rows_anc[parent_row]
        offset += k * k
    q = None
    if with_q:  # over every token: a draft vocabulary's logits lack the rest, so recompute from the states
        q = torch.cat(q_logits) if vocab is None else drafter.logits(torch.cat(q_states), full=True)
    return _rerank(root_token, cand_tok, cand_score, cand_parent, cand_depth, q, q_cands, cfg)


def _top_logprobs(logits: torch.Tensor, k: int, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of draft logits ``[R, V_d]`` (columns: ``vocab``'s ids, or every
    token) and their log-probs ``[R, k]``: the top k of the logits minus the row's logsumexp (no [R, V]
    log-softmax is written)."""
    logits = logits.float()
    vals, col = topk(logits, k)
    return vals - logits.logsumexp(-1, keepdim=True), (col if vocab is None else vocab[col])


def _rerank(root_token, cand_tok, cand_score, cand_parent, cand_depth, q_logits, q_cands, cfg: TreeConfig) -> DraftTree:
    dev = root_token.device
    tokens, scores, parents = torch.cat(cand_tok), torch.cat(cand_score), torch.cat(cand_parent)
    depths = torch.cat([torch.full((t.shape[0],), d, device=dev) for t, d in zip(cand_tok, cand_depth)])
    total = tokens.shape[0]
    n_keep = min(cfg.total_tokens - 1, total)
    # Stable sort on a depth-major candidate list: on score ties a parent stays ahead of its child, so the
    # kept set is connected (a child's cumulative log-prob never exceeds its parent's).
    order = torch.sort(scores, descending=True, stable=True).indices[:n_keep]
    order = order[torch.argsort(depths[order] * n_keep + torch.arange(n_keep, device=dev))]
    node_of = torch.full((total,), -1, dtype=torch.long, device=dev)
    node_of[order] = torch.arange(1, n_keep + 1, device=dev)
    par = parents[order]
    node_parents = torch.cat([torch.zeros(1, dtype=torch.long, device=dev),
                              torch.where(par < 0, 0, node_of[par.clamp(min=0)])])
    n = n_keep + 1
    idx = torch.arange(n, device=dev)
    # Item assignment with a Python scalar copies from the host (not graph-capturable): build masks instead.
    anc = (idx.unsqueeze(1) == idx.unsqueeze(0)) | (node_parents.unsqueeze(1) == idx.unsqueeze(0))
    for _ in range(cfg.depth - 1):
        anc = anc | anc[node_parents]
    # q rows: the root is row 0, level-d frontier row j is row 1 + (d - 1) * k + j.
    q_row_of = torch.full((total,), -1, dtype=torch.long, device=dev)
    for d, cands in enumerate(q_cands):
        q_row_of[cands] = 1 + d * cfg.top_k + torch.arange(cands.shape[0], device=dev)
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    return DraftTree(
        tokens=torch.cat([root_token.reshape(1), tokens[order]]),
        parents=node_parents,
        depths=torch.cat([zero, depths[order]]),
        anc=anc,
        scores=torch.cat([torch.zeros(1, device=dev), scores[order]]),
        q_logits=q_logits,
        q_row=torch.cat([zero, q_row_of[order]]),
        max_depth=cfg.depth,
    )
