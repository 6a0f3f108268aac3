"""EAGLE-2 dynamic draft tree (Li et al. 2024, Sec. 4): expansion by cumulative draft log-probability, then
reranking to the ``total_tokens`` best nodes. All shapes are fixed by the TreeConfig: no host syncs.

Node 0 is the root (the last token chosen by the target, not yet in the KV cache); nodes are ordered by
depth, and within a depth by descending score, so every parent precedes its children.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from . import kernels
from .config import TreeConfig
from .kernels import topk
from .rng import DRAW_CHILDREN, index_bits, to_uniform


@dataclass
class DraftTree:
    """B token trees (one per batch row), each verified in one forward, with n = nodes per tree (root
    included; every row's tree has n nodes, each its own shape).

    tokens ``[B, n]``; parents ``[B, n]`` (root's parent is itself, 0); depths ``[B, n]`` (root 0); anc
    ``[B, n, n]`` bool, anc[b, i, j] = node j is an ancestor of i or i itself; scores ``[B, n]``: cumulative
    draft log-prob (root 0; normalised over the draft vocabulary); q_logits ``[B, R, V]``: the draft's logits
    over every token at each expanded node (its children's distribution q_n; None unless asked for); q_row
    ``[B, n]``: row of q_logits for a node, -1 where the node was never expanded.
    max_depth: static bound on any node's depth (accepted paths have at most max_depth + 1 nodes).
    r_logits ``[B, R, S]``: with sampled children, the draft logits that each expanded node's children were
    drawn from (rows as q_row), over S = V_d columns: the draft vocabulary (``r_vocab``'s ids, or every token
    when None); or, when drawn from a pool (TreeConfig.pool), over each row's own S = pool most likely draft
    tokens, whose ids are ``r_tokens`` ``[B, R, pool]``.
    max_children: the most children a node has (the tree's top_k; set with r_logits).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    anc: torch.Tensor
    scores: torch.Tensor
    q_logits: torch.Tensor | None
    q_row: torch.Tensor
    max_depth: int
    r_logits: torch.Tensor | None = None
    r_vocab: torch.Tensor | None = None
    r_tokens: torch.Tensor | None = None
    max_children: int = 0

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]


class Drafter(Protocol):
    """What tree drafting needs from a draft head or a draft model (see fsd_eagle.drafter). ``vocab``: the
    token ids ``[V_d]`` that its logits' columns stand for (None: every token)."""

    vocab: torch.Tensor | None

    def logits(self, states: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Draft logits of states ``[..., s]``: over ``vocab``, or over every token with ``full``."""
        ...

    def step(self, depth: int, tokens: torch.Tensor, states: torch.Tensor, rows_anc: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft one tree level of every batch row: frontier tokens ``[B, k]`` at ``depth`` (1-based), their
        parents' states ``[B, k, s]``, and ``rows_anc [B, k, A]``: which draft rows (A = (depth_max - 1) * k,
        level-major) each frontier row sees (its ancestors and itself). Returns logits ``[B, k, V_d]`` and
        states ``[B, k, s]``."""
        ...


def root_tree(root_token: torch.Tensor) -> DraftTree:
    """The trees of plain autoregressive decoding: each row's root alone. root_token ``[B]``."""
    b, dev = root_token.shape[0], root_token.device
    zero = torch.zeros(b, 1, dtype=torch.long, device=dev)
    return DraftTree(root_token.reshape(b, 1), zero, zero, torch.ones(b, 1, 1, dtype=torch.bool, device=dev),
                     torch.zeros(b, 1, device=dev), None, zero - 1, 0)


def draft_tree(drafter: Drafter, root_token: torch.Tensor, root_logits: torch.Tensor, root_state: torch.Tensor,
               cfg: TreeConfig, with_q: bool = False, rng=None, temperature: torch.Tensor | None = None
               ) -> DraftTree:
    """Grow one EAGLE-2 tree per batch row from the roots' tokens ``[B]``, draft logits ``[B, V_d]`` and
    states ``[B, s]``.

    Level 1 takes the top_k tokens of q_root; each later level expands the current frontier (top_k nodes),
    scores the top_k x top_k children by cumulative log-prob and keeps the global top_k as the next
    frontier. Finally the ``total_tokens - 1`` best candidates (a connected subtree) become the tree.
    Scores are the draft's log-probs at temperature 1 also when the call samples: rescoring them at the
    call's temperature (0.7), or flatter (1.43), accepted 2-5 % fewer tokens per round on MT-bench
    (eval/results/archive/gpu_tree_scores_h200_1af56b1.json).
    ``with_q``: also return the draft's distributions over every token (q_logits; the fuzzy rule's q_n).
    ``rng`` (a RandomStream) and ``temperature`` ``[B]``: sampled children instead of the top k: each
    expanded node's k children are drawn without replacement from its draft distribution at the row's
    temperature (Gumbel-top-k, keys from the stream's DRAW_CHILDREN draws), in the order drawn, from the
    whole draft vocabulary or from its ``cfg.pool`` most likely tokens; the draws get, in that order, the
    sorted log-probs of the drawn set, so that pruning keeps a prefix of the draws (what recursive rejection
    sampling without replacement needs to stay lossless) while a node's budget follows the quality of all
    its draws; the proposal's logits (and a pool's token ids) go with the tree for the verifier.
    """
    k, depth, dev, vocab = cfg.top_k, cfg.depth, root_logits.device, drafter.vocab
    b, s = root_state.shape
    pool = min(cfg.pool, root_logits.shape[-1])  # a pool larger than the draft vocabulary is all of it
    proposals: list[Proposal] = []
    # every level's random words at once (draws DRAW_CHILDREN + level): one small kernel per round
    words = None if rng is None or not pool else rng.words(torch.arange(DRAW_CHILDREN, DRAW_CHILDREN + depth,
                                                                        device=dev))

    def children(logits: torch.Tensor, level: int) -> tuple[torch.Tensor, torch.Tensor]:
        if rng is None:
            return _top_logprobs(logits, k, vocab)
        rows = logits.shape[0] // b
        if not pool:
            u = rng.uniform((rows, logits.shape[1]), DRAW_CHILDREN + level).flatten(0, 1)
            return _sampled_children(logits, k, vocab, temperature.repeat_interleave(rows).unsqueeze(1), u)
        found = _pool_children(logits, k, pool, vocab, temperature, words, level, rows)
        proposals.append(Proposal(found.logits.view(b, rows, pool), found.tokens.view(b, rows, pool)))
        return found.scores, found.children

    score, tok = children(root_logits, 0)  # [B, k]
    cand_tok, cand_score, cand_parent, cand_depth = [tok], [score], [torch.full((b, k), -1, device=dev)], [1]
    q_logits, q_states, q_cands = [root_logits.unsqueeze(1)], [root_state.unsqueeze(1)], []
    frontier = torch.arange(k, device=dev).expand(b, k)  # candidate indices of the frontier
    states = root_state.unsqueeze(1).expand(b, k, s)
    area = (depth - 1) * k
    rows_anc = torch.zeros(b, k, area, dtype=torch.bool, device=dev)
    eye = torch.eye(k, dtype=torch.bool, device=dev)
    offset = k
    for d in range(1, depth):
        rows_anc[:, :, (d - 1) * k: d * k] = eye
        logits, out_states = drafter.step(d, tok, states, rows_anc)  # [B, k, V_d], [B, k, s]
        q_logits.append(logits)
        q_states.append(out_states)
        q_cands.append(frontier)
        child_score, child_tok = children(logits.flatten(0, 1), d)  # [B * k, k]
        cum = (score.unsqueeze(2) + child_score.view(b, k, k)).view(b, k * k)
        child_tok = child_tok.view(b, k * k)
        cand_tok.append(child_tok)
        cand_score.append(cum)
        cand_parent.append(frontier.repeat_interleave(k, dim=1))
        cand_depth.append(d + 1)
        if d < depth - 1:
            score, best = topk(cum, k)
            parent_row = best // k
            tok, frontier = child_tok.gather(1, best), offset + best
            states = out_states.gather(1, parent_row.unsqueeze(2).expand(b, k, s))
            rows_anc = rows_anc.gather(1, parent_row.unsqueeze(2).expand(b, k, area))
        offset += k * k
    q = None
    if with_q:  # over every token: a draft vocabulary's logits lack the rest, so recompute from the states
        q = torch.cat(q_logits, 1) if vocab is None else drafter.logits(torch.cat(q_states, 1), full=True)
    tree = _rerank(root_token, cand_tok, cand_score, cand_parent, cand_depth, q, q_cands, cfg)
    if rng is None:
        return tree
    if pool:
        return replace(tree, r_logits=torch.cat([p.logits for p in proposals], 1),
                       r_tokens=torch.cat([p.tokens for p in proposals], 1), max_children=k)
    return replace(tree, r_logits=torch.cat(q_logits, 1), r_vocab=vocab, max_children=k)


@dataclass
class Proposal:
    """Where one draft level's sampled children came from, per expanded row: the pool's draft logits and
    token ids, both ``[B, rows, pool]``."""

    logits: torch.Tensor
    tokens: torch.Tensor


@dataclass
class PoolDraw:
    """k children drawn from each row's pool (``_pool_children``): their scores and token ids ``[R, k]``,
    the pool's logits and token ids ``[R, pool]``."""

    scores: torch.Tensor
    children: torch.Tensor
    logits: torch.Tensor
    tokens: torch.Tensor


def _top_logprobs(logits: torch.Tensor, k: int, vocab: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of draft logits ``[R, V_d]`` (columns: ``vocab``'s ids, or every
    token) and their log-probs ``[R, k]``: the top k of the logits minus the row's logsumexp (no [R, V]
    log-softmax is written)."""
    logits = logits.float()
    vals, col = topk(logits, k)
    return vals - logits.logsumexp(-1, keepdim=True), (col if vocab is None else vocab[col])


def _sampled_children(logits: torch.Tensor, k: int, vocab: torch.Tensor | None, temperature: torch.Tensor,
                      u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k tokens of each row of draft logits ``[R, V_d]`` drawn without replacement from softmax(logits / T)
    (the top k of logits / T plus Gumbel noise from the uniforms ``u`` ``[R, V_d]``), in the order drawn,
    and scores for them: the drawn set's log-probs (at temperature 1, as the tree scores nodes) sorted in
    descending order, so that the i-th draw never outranks an earlier one."""
    logits = logits.float()
    _, col = topk(logits / temperature - torch.log(-torch.log(u)), k)
    logp = logits.gather(1, col) - logits.logsumexp(-1, keepdim=True)
    return logp.sort(dim=1, descending=True).values, (col if vocab is None else vocab[col])


def _pool_children(logits: torch.Tensor, k: int, pool: int, vocab: torch.Tensor | None, temperature: torch.Tensor,
                   words: tuple[torch.Tensor, torch.Tensor], level: int, rows: int) -> PoolDraw:
    """k tokens of each row of draft logits ``[R, V_d]`` (R = B x ``rows``, batch row-major) drawn without
    replacement from the row's ``pool`` most likely tokens at its batch row's temperature T (``[B]``):
    softmax of their logits / T, as the Gumbel-top-k of the pool's logits with the uniforms of draw
    DRAW_CHILDREN + ``level`` (``words``: every level's, ``RandomStream.words``), in the order drawn, scored
    as ``_sampled_children`` scores. On CUDA with Triton the draw is one kernel (``kernels.pool_draw``); the
    torch ops below give the same draws (tests/test_engine.py compares them)."""
    logits = logits.float()
    vals, col = topk(logits, pool)  # [R, pool], the pool in descending order
    if kernels.fits_pool_draw(vals, k):
        drawn, drawn_vals = kernels.pool_draw(vals, temperature, *words, level, rows, k)
    else:
        u = to_uniform(index_bits(words[0][:, level], words[1][:, level], (rows, pool))).flatten(0, 1)
        temp = temperature.repeat_interleave(rows).unsqueeze(1)
        _, drawn = topk(vals / temp - torch.log(-torch.log(u)), k)  # positions in the pool, in draw order
        drawn_vals = vals.gather(1, drawn).sort(dim=1, descending=True).values
    tokens = col if vocab is None else vocab[col]
    return PoolDraw(drawn_vals - logits.logsumexp(-1, keepdim=True), tokens.gather(1, drawn), vals, tokens)


def _rerank(root_token, cand_tok, cand_score, cand_parent, cand_depth, q_logits, q_cands, cfg: TreeConfig) -> DraftTree:
    dev, b = root_token.device, root_token.shape[0]
    tokens, scores, parents = torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_parent, 1)
    depths = torch.cat([torch.full((t.shape[1],), d, device=dev) for t, d in zip(cand_tok, cand_depth)])
    total = tokens.shape[1]
    n_keep = min(cfg.total_tokens - 1, total)
    # Stable sort on a depth-major candidate list: on score ties a parent stays ahead of its child, so the
    # kept set is connected (a child's cumulative log-prob never exceeds its parent's).
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n_keep]  # [B, K]
    order = order.gather(1, torch.argsort(depths[order] * n_keep + torch.arange(n_keep, device=dev), dim=1))
    ranks = torch.arange(1, n_keep + 1, device=dev).expand(b, n_keep)
    node_of = torch.full((b, total), -1, dtype=torch.long, device=dev).scatter(1, order, ranks)
    par = parents.gather(1, order)
    zero = torch.zeros(b, 1, dtype=torch.long, device=dev)
    node_parents = torch.cat([zero, torch.where(par < 0, 0, node_of.gather(1, par.clamp(min=0)))], 1)  # [B, n]
    n = n_keep + 1
    idx = torch.arange(n, device=dev)
    # Item assignment with a Python scalar copies from the host (not graph-capturable): build masks instead.
    anc = (idx.view(1, n, 1) == idx.view(1, 1, n)) | (node_parents.unsqueeze(2) == idx.view(1, 1, n))
    for _ in range(cfg.depth - 1):
        anc = anc | anc.gather(1, node_parents.unsqueeze(2).expand(b, n, n))
    # q rows: the root is row 0, level-d frontier row j is row 1 + (d - 1) * k + j.
    q_row_of = torch.full((b, total), -1, dtype=torch.long, device=dev)
    for d, cands in enumerate(q_cands):
        rows = (1 + d * cfg.top_k + torch.arange(cands.shape[1], device=dev)).expand(b, -1)
        q_row_of = q_row_of.scatter(1, cands, rows)
    return DraftTree(
        tokens=torch.cat([root_token.view(b, 1), tokens.gather(1, order)], 1),
        parents=node_parents,
        depths=torch.cat([zero, depths[order]], 1),
        anc=anc,
        scores=torch.cat([torch.zeros(b, 1, device=dev), scores.gather(1, order)], 1),
        q_logits=q_logits,
        q_row=torch.cat([zero, q_row_of.gather(1, order)], 1),
        max_depth=cfg.depth,
    )
