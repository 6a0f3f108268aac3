"""Tree verification: one verifier, pluggable acceptance rules (exact greedy, exact sampling, fuzzy).

Symbols: for a tree node n, p_n is the target's next-token distribution at n (from the verify forward)
and q_n the draft's distribution from which n's children were drafted. FSD (Holsman et al. 2025) also
accepts a child when D(p_n, q_n) <= T. Everything here is tensor code without host syncs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kernels
from .config import FuzzyConfig, SamplingConfig, TreeConfig
from .divergence import divergence
from .ops import pick
from .rng import DRAW_ACCEPT, DRAW_TOKEN, RandomStream
from .sampling import RuleForm, RuleValues, process_logits, sample
from .tree import DraftTree


@dataclass(frozen=True)
class AcceptanceRule:
    """Which draft tokens the target accepts: its sampling settings plus the fuzzy rule (off by default).

    Greedy + exact: a child is accepted iff it is the argmax of p at its parent (EAGLE-2).
    Sampling + exact: EAGLE-2's recursive rejection over the (deterministic) draft's children, or, with
    sampled children, recursive rejection sampling without replacement over children drawn from the draft.
    Fuzzy hybrid: the exact rule, or else the draft's top child when D(p_n, q_n) <= T (with sampled
    children: the first child drawn, a sample of q_n, as in the paper's speculative sampling).
    Fuzzy pure: the draft's top (first drawn) child iff D(p_n, q_n) <= T.
    """

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    fuzzy: FuzzyConfig = field(default_factory=FuzzyConfig)

    @property
    def form(self) -> RuleForm:
        """What a round's code depends on (the rest are numbers, ``values``): one captured graph or compiled
        round serves every temperature, top-p, top-k and threshold of a form. Children "auto" count as
        "top" here: ``form_for`` resolves them with the tree."""
        return self.form_for(None)

    def form_for(self, tree: TreeConfig | None) -> RuleForm:
        """The form of this rule's rounds on ``tree``: children "auto" are sampled where the tree draws them
        from a pool (``TreeConfig.pool``), else the top ones."""
        s, f = self.sampling, self.fuzzy
        filtered = not s.greedy and (s.top_k > 0 or s.top_p < 1.0)
        pooled = tree is not None and tree.pool > 0
        sampled_children = not s.greedy and (s.children == "sampled" or (s.children == "auto" and pooled))
        if not f.active:  # the exact rule: no divergences, whatever their settings
            return RuleForm(greedy=s.greedy, filtered=filtered, sampled_children=sampled_children)
        return RuleForm(s.greedy, filtered, True, f.divergence, f.mode, f.support_top_k, f.processed,
                        sampled_children)

    def values(self, device: torch.device | str = "cpu") -> RuleValues:
        """The rule's numbers as device tensors (see RuleValues)."""
        values = RuleValues.create(device)
        values.set(self)
        return values


@dataclass
class Verdict:
    """Outcome of one round for each of B batch rows (all tensors on the device, nothing synced).

    path ``[B, P]``: accepted node indices from the root, padded by repeating the last one (P = depth + 1);
    n_accepted ``[B]``: nodes on the path, root included; bonus ``[B]``: the target's token after the path;
    fuzzy_extra ``[B]``: draft tokens accepted beyond what the exact rule accepts here; div_sum, div_count
    ``[B]``: the divergences D(p_n, q_n) at the path's decision nodes (for statistics).
    """

    path: torch.Tensor
    n_accepted: torch.Tensor
    bonus: torch.Tensor
    fuzzy_extra: torch.Tensor
    div_sum: torch.Tensor
    div_count: torch.Tensor


def verify_tree(tree: DraftTree, target_logits: torch.Tensor, form: RuleForm, values: RuleValues,
                rng: RandomStream | None = None) -> Verdict:
    """Accept a root path of each row's tree under the rule ``form`` with its row's numbers ``values``;
    ``target_logits [B, n, V]`` are the raw float32 logits of the verify forward (row i: the target's
    distribution for the children of node i). ``rng``: the rows' random streams (sampling forms only; read,
    not advanced)."""
    (b, n), dev = tree.tokens.shape, target_logits.device
    if form.fuzzy and tree.q_logits is not None:
        div = node_divergences(tree, target_logits, form, values)
        fuzzy_ok = (div.gather(1, tree.parents) <= values.threshold.unsqueeze(1)) & top_children(tree)
    else:  # the exact rule: no divergence work in the loop
        div = torch.full((b, n), float("inf"), device=dev)
        fuzzy_ok = torch.zeros(b, n, dtype=torch.bool, device=dev)
    if form.greedy:
        path, n_acc, bonus, exact_len = _accept_greedy(tree, target_logits, fuzzy_ok, form)
    elif form.sampled_children and tree.r_logits is not None:  # (plain decoding has no children to sample)
        path, n_acc, bonus, exact_len = _accept_sampled_children(tree, target_logits, fuzzy_ok, form, values, rng)
    else:
        path, n_acc, bonus, exact_len = _accept_sampling(tree, target_logits, fuzzy_ok, form, values, rng)
    path_div = div.gather(1, path)
    decided = (torch.arange(path.shape[1], device=dev) < n_acc.unsqueeze(1)) & torch.isfinite(path_div)
    # Pure mode may accept fewer tokens than the exact rule would: that is no extra, not a negative one.
    return Verdict(path, n_acc, bonus, (n_acc - exact_len).clamp(min=0),
                   torch.where(decided, path_div, 0.0).sum(1), decided.sum(1))


def node_divergences(tree: DraftTree, target_logits: torch.Tensor, form: RuleForm, values: RuleValues) -> torch.Tensor:
    """D(p_n, q_n) for every node ``[B, n]`` (float32); +inf where the node was never expanded."""
    p = target_logits
    q = tree.q_logits.gather(1, tree.q_row.clamp(min=0).unsqueeze(2).expand(-1, -1, p.shape[2])).float()
    if form.processed:
        p, q = process_logits(p, form, values), process_logits(q, form, values)
    d = divergence(form.divergence, p, q, form.support_top_k)
    return torch.where(tree.q_row >= 0, d, torch.full_like(d, float("inf")))


def top_children(tree: DraftTree) -> torch.Tensor:
    """``[B, n]`` bool: the node is its parent's child of highest draft probability."""
    best = torch.full(tree.scores.shape, float("-inf"), device=tree.scores.device)
    best = best.scatter_reduce(1, tree.parents[:, 1:], tree.scores[:, 1:], reduce="amax")
    return (tree.scores == best.gather(1, tree.parents)) & (torch.arange(tree.size, device=best.device) > 0)


def root_path(tree: DraftTree, node: torch.Tensor) -> torch.Tensor:
    """Root-to-``node`` indices ``[B, max_depth + 1]`` per row (nodes are depth-ordered), padded with
    ``node`` ``[B]``."""
    idx = torch.arange(tree.size, device=node.device)
    on_path = pick(tree.anc, node)  # [B, n]
    path = torch.sort(torch.where(on_path, idx, tree.size + idx), dim=1).values[:, : tree.max_depth + 1]
    return torch.where(path < tree.size, path, node.unsqueeze(1))


def deepest_accepted(tree: DraftTree, ok: torch.Tensor, exact_ok: torch.Tensor | None = None) -> torch.Tensor:
    """Per row ``[B]``: the deepest node whose whole root path is ``ok`` ``[B, n]``. Ties go to the path with
    the most exactly accepted nodes (``exact_ok``: fuzzy acceptance must not replace the target's own choice
    for no gain), then to the first node, i.e. the best-scored."""
    accepted = ~(tree.anc & ~ok.unsqueeze(1)).any(dim=2)
    key = tree.depths * (tree.max_depth + 2)
    if exact_ok is not None:
        key = key + (tree.anc & exact_ok.unsqueeze(1)).sum(dim=2)
    return torch.argmax(torch.where(accepted, key, -1), dim=1)


def _accept_greedy(tree, logits, fuzzy_ok, form):
    """A node is ok if it is the target's argmax at its parent (exact) or passes the fuzzy test; in a tree
    both continue a branch, and the longest branch wins (so acceptance grows monotonically with T)."""
    argmax = logits.argmax(dim=-1)  # [B, n]
    is_root = torch.arange(tree.size, device=logits.device) == 0
    exact_ok = (tree.tokens == argmax.gather(1, tree.parents)) | is_root
    fuzzy_ok = fuzzy_ok | is_root
    ok = fuzzy_ok if form.mode == "pure" else exact_ok | fuzzy_ok
    best = deepest_accepted(tree, ok, exact_ok)
    exact_len = pick(tree.depths, deepest_accepted(tree, exact_ok)) + 1
    return root_path(tree, best), pick(tree.depths, best) + 1, pick(argmax, best), exact_len


def _accept_sampling(tree, logits, fuzzy_ok, form, values, rng):
    """Walk down from the root. At node c, try its children in draft order: accept child x with probability
    p(x) / (1 - mass of the children already rejected) (EAGLE-2's recursive rejection with a deterministic
    draft: lossless). If all are rejected, the fuzzy rule may still take the top child; else the walk ends
    at c, and the bonus is a sample of p_c with c's (rejected) children removed (pure mode: of p_c itself).
    A walk that runs out of tree ends at a leaf, whose p has nothing to remove: one bonus draw serves both.
    Every batch row walks its own tree at once.

    Random numbers: one uniform per (level, node) and one race over the vocabulary for the bonus, all
    from each row's stream at its current step."""
    (b, n), dev = tree.tokens.shape, logits.device
    probs = process_logits(logits, form, values).softmax(-1)  # [B, n, V]
    pure = form.mode == "pure"
    not_root = torch.arange(n, device=dev) > 0
    top = top_children(tree)
    uniforms = rng.uniform((tree.max_depth, n), DRAW_ACCEPT)  # [B, depth, n]
    cur, alive, exact_alive, n_acc, exact_len = _walk_start(b, dev)
    for level in range(tree.max_depth):
        p = pick(probs, cur)  # [B, V]
        children = (tree.parents == cur.unsqueeze(1)) & not_root
        p_child = torch.where(children, p.gather(1, tree.tokens), 0.0)
        rejected_before = torch.cumsum(p_child, 1) - p_child
        success = children & (uniforms[:, level] * (1.0 - rejected_before).clamp(min=1e-12) < p_child)
        exact_step = success.any(1)  # the exact rule accepts a child here (statistics, also in pure mode)
        exact_go = exact_step & (not pure)
        top_child = torch.argmax((children & top).int(), 1)
        fuzzy_go = children.any(1) & pick(fuzzy_ok, top_child)
        go = exact_go | fuzzy_go
        nxt = torch.where(exact_go, torch.argmax(success.int(), 1), top_child)
        exact_alive = exact_alive & exact_step & alive
        exact_len = exact_len + exact_alive
        cur = torch.where(alive & go, nxt, cur)
        n_acc = n_acc + (alive & go)
        alive = alive & go
    p = pick(probs, cur)
    rejected = (tree.parents == cur.unsqueeze(1)) & not_root
    bonus = sample(p if pure else _remove(p, tree.tokens, rejected), rng, DRAW_TOKEN)
    return root_path(tree, cur), n_acc, bonus, exact_len


def child_slots(tree: DraftTree, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's children in the order they were drawn (node order among siblings): ``kids [B, n, slots]``,
    the node index of a node's j-th child, and ``exists [B, n, slots]``, whether it has one (a prefix of the
    slots). Dense masks of ``[B, n, slots, n]``, no scatter."""
    b, n = tree.tokens.shape
    idx = torch.arange(n, device=tree.tokens.device)
    not_root = idx > 0
    earlier_sibling = ((tree.parents.unsqueeze(2) == tree.parents.unsqueeze(1)) & (idx.view(n, 1) > idx.view(1, n))
                       & not_root.view(1, 1, n))  # [B, i, j]: j is a sibling drawn before i
    rank = earlier_sibling.sum(2)  # [B, n]
    slot_ids = torch.arange(slots, device=idx.device)
    is_kid = ((tree.parents.view(b, 1, 1, n) == idx.view(1, n, 1, 1)) & (rank.view(b, 1, 1, n) == slot_ids.view(1, 1, slots, 1))
              & not_root.view(1, 1, 1, n))  # [B, parent, slot, child]
    return torch.argmax(is_kid.int(), 3), is_kid.any(3)


def _accept_sampled_children(tree, logits, fuzzy_ok, form, values, rng):
    """The sampled-children rule (``sampled_children_walk``) with the rows' random numbers: one uniform per
    (level, child slot), one race for the bonus."""
    probs = process_logits(logits, form, values).softmax(-1)  # [B, n, V]
    uniforms = rng.uniform((tree.max_depth, tree.max_children), DRAW_ACCEPT)  # [B, depth, slots]
    end, n_acc, exact_len, p_end = sampled_children_walk(tree, probs, fuzzy_ok, form.mode == "pure",
                                                         values.temperature, uniforms)
    return root_path(tree, end), n_acc, sample(p_end, rng, DRAW_TOKEN), exact_len


def sampled_children_walk(tree: DraftTree, probs: torch.Tensor, fuzzy_ok: torch.Tensor, pure: bool,
                          temperature: torch.Tensor, uniforms: torch.Tensor):
    """Recursive rejection sampling without replacement over sampled children (``draft_tree`` with an rng).

    Walk down from the root; at node c with target distribution p (``probs [B, n, V]``, processed) and the
    draft's r (``tree.r_logits`` at ``temperature [B]``, over the draft vocabulary or the node's pool), try c's children in the
    order they were drawn: child x is accepted iff u < p(x) / r(x), u = ``uniforms [B, depth, slots]`` at
    (c's depth, x's slot); on rejection p becomes max(p - r, 0) renormalised and r loses x, renormalised.
    If every child is rejected, the fuzzy rule may still take the first child drawn (``fuzzy_ok [B, n]``:
    D(p_c, q_c) <= T at its parent; hybrid mode), else the walk ends at c with the last p as the bonus
    distribution (at a node without children, p_c itself). Pure mode takes the first child iff it is
    fuzzy-ok, and otherwise ends with p_c. Without the fuzzy rule the output is distributed as the target's
    samples, whatever r is.

    What happens at a node depends only on that node (its p, r, children and uniforms), so every node's
    tests are made at once, before the walk: ``_rejection_states`` over ``[B, n, V_d]`` (one sum over the
    draft vocabulary per child slot, for all nodes together); the walk then only follows each node's
    verdict, and the bonus distribution is written once, for the node where the walk ends. Tokens outside
    the draft vocabulary (or the pool) have r = 0: they keep p, and enter the sums as one constant per node,
    so that with a pool every sum runs over its S entries.

    Returns the end node ``[B]``, the accepted lengths (root included) of this rule and of the exact rule
    alone ``[B]``, and the bonus distribution ``[B, V]`` (unnormalised)."""
    (b, n), slots = tree.tokens.shape, tree.max_children
    kids, exists = child_slots(tree, slots)  # [B, n, slots]
    x = tree.tokens.gather(1, kids.flatten(1)).view(b, n, slots)  # the children's tokens, distinct per node
    r, p_d, outside, cols, support = _proposal_at_nodes(tree, probs, temperature, x)
    px, rx = probs.gather(2, x), r.gather(2, cols)  # [B, n, slots]
    coef, mass, r_mass, kept = _rejection_states(p_d, r, px, rx, exists, outside)
    p_x = (px - coef[..., :slots] * rx).clamp(min=0)  # each child's p (unnormalised) when its turn comes
    u = uniforms.gather(1, tree.depths.clamp(max=tree.max_depth - 1).unsqueeze(2).expand(b, n, slots))
    take = exists & (u * rx * mass[..., :slots] < p_x * r_mass[..., :slots])  # u < p(x) / r(x)
    accepted = take.any(2)  # [B, n]: the exact rule takes one of the node's children
    taken = kids.gather(2, torch.argmax(take.int(), 2, keepdim=True)).squeeze(2)  # the first child taken
    has_kids, first = exists[..., 0], kids[..., 0]
    cur, alive, exact_alive, n_acc, exact_len = _walk_start(b, probs.device)
    for _ in range(tree.max_depth):
        exact_here, first_c = pick(accepted, cur), pick(first, cur)
        exact_alive = exact_alive & exact_here & alive
        exact_len = exact_len + exact_alive
        fuzzy_go = pick(has_kids, cur) & pick(fuzzy_ok, first_c)
        if pure:
            go, nxt = fuzzy_go, first_c
        else:
            go, nxt = exact_here | fuzzy_go, torch.where(exact_here, pick(taken, cur), first_c)
        cur = torch.where(alive & go, nxt, cur)
        n_acc = n_acc + (alive & go)
        alive = alive & go
    # The walk ends at a node whose children were all rejected, or that has none (where the residual is p).
    p_end = pick(probs, cur)
    if not pure:
        r_end = pick(r, cur)
        if support is not None:
            r_end = torch.zeros_like(p_end).scatter(1, pick(support, cur), r_end)
        p_end = _residual_after_all(p_end, r_end, pick(x, cur), pick(px, cur), pick(rx, cur), pick(exists, cur),
                                    pick(coef, cur)[:, -1:], pick(mass, cur)[:, -1:], pick(kept, cur))
    return cur, n_acc, exact_len, p_end


def _proposal_at_nodes(tree: DraftTree, probs: torch.Tensor, temperature: torch.Tensor, x: torch.Tensor):
    """The children's proposal r at every node and the target's p on r's columns.

    probs ``[B, n, V]``; x ``[B, n, slots]``: each node's children's tokens. Returns r ``[B, n, S]`` (the
    draft at ``temperature`` over the node's S columns: the draft vocabulary, every token, or the node's
    pool), p_d ``[B, n, S]`` (p there), outside ``[B, n]`` (p's mass off those columns; 0 when they are every
    token), cols ``[B, n, slots]`` (each child's column) and support: the columns' token ids ``[B, n, S]``
    (None: column i is token i)."""
    b, n, slots = x.shape
    rows = tree.q_row.clamp(min=0).unsqueeze(2).expand(b, n, tree.r_logits.shape[2])
    r = (tree.r_logits.float() / temperature.view(-1, 1, 1)).softmax(-1).gather(1, rows)
    if tree.r_tokens is not None:  # a pool per expanded row: find each child among its parent's pool
        support = tree.r_tokens.gather(1, rows)
        cols = torch.argmax((support.unsqueeze(3) == x.unsqueeze(2)).int(), 2)
    elif tree.r_vocab is not None:
        support = tree.r_vocab.view(1, 1, -1).expand(b, n, -1)
        cols = _draft_columns(tree.r_vocab, probs.shape[2]).gather(0, x.flatten()).view(b, n, slots)
    else:
        return r, probs, 0.0, x, None
    p_d = probs.gather(2, support)
    # p sums to 1 (a softmax): the mass off the columns needs no pass over the vocabulary
    return r, p_d, (1.0 - p_d.sum(-1)).clamp(min=0), cols, support


def _draft_columns(vocab: torch.Tensor, size: int) -> torch.Tensor:
    """``[size]``: the column of each token id in a draft vocabulary ``vocab`` ``[V_d]`` (0 for tokens outside
    it, which no drafted child is)."""
    columns = torch.arange(vocab.shape[0], device=vocab.device)
    return torch.zeros(size, dtype=torch.long, device=vocab.device).scatter(0, vocab, columns)


def _walk_start(b: int, dev: torch.device):
    """A walk down B rows' trees at its start: the current node (the root), whether the walk goes on (any
    rule), whether the exact rule alone would still go on, and the accepted lengths of both (the root)."""
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    n_acc = torch.ones(b, dtype=torch.long, device=dev)
    return cur, alive, alive.clone(), n_acc, n_acc.clone()


def _rejection_states(p: torch.Tensor, r: torch.Tensor, px: torch.Tensor, rx: torch.Tensor, exists: torch.Tensor,
                      outside: torch.Tensor | float = 0.0):
    """The state of recursive rejection at a node before each of its child slots, given that every earlier
    child was rejected (the only way a slot's turn comes), and after all of them (column ``slots``); for any
    leading dimensions ``...`` (the nodes of B rows' trees: ``[B, n]``).

    p ``[..., V]``: the target's distribution at the node (over the tokens r covers, with ``outside`` ``[...]``
    the mass of those it leaves out, where r is 0); r ``[..., V]``: the draft's, the children's proposal;
    px, rx ``[..., slots]``: both at the children's tokens in the order drawn; exists: which slots hold a
    child (a prefix). Returns coef, mass, r_mass ``[..., slots + 1]`` and kept ``[..., slots]``: before slot
    j, p (unnormalised) is max(p - coef_j * r, 0) of sum mass_j except at the tokens of slots < j, which
    kept their values kept_i, and r has r_mass_j left (r without those tokens). Each rejection is
    ``_residual_coefficient``: no distribution is rewritten, one sum over the vocabulary per slot. On CUDA
    with Triton, over a pool (at most kernels.MAX_POOL columns): ``kernels.rejection_states``, one kernel."""
    slots = px.shape[-1]
    if kernels.fits_rejection_states(p, slots):
        return kernels.rejection_states(p, r, px, rx, exists, outside)
    coef = [torch.zeros(px.shape[:-1], device=p.device)]
    mass, r_mass, kept = [torch.ones_like(coef[0])], [torch.ones_like(coef[0])], []
    for slot in range(slots):
        there = exists[..., slot]
        coef.append(torch.where(there, _residual_coefficient(coef[-1], mass[-1], r_mass[-1]), coef[-1]))
        r_mass.append(torch.where(there, (r_mass[-1] - rx[..., slot]).clamp(min=1e-30), r_mass[-1]))
        at = (px[..., : slot + 1] - coef[-1].unsqueeze(-1) * rx[..., : slot + 1]).clamp(min=0)  # [..., slot + 1]
        kept.append(at[..., slot])  # the rejected token keeps its value from here on
        # every token at the new coefficient, less what that gives the earlier rejected tokens over their kept values
        earlier = (at[..., :slot] - torch.stack(kept[:slot], -1)).sum(-1) if slot else 0.0
        total = (p - coef[-1].unsqueeze(-1) * r).clamp(min=0).sum(-1) + outside - earlier
        mass.append(torch.where(there, total.clamp(min=1e-30), mass[-1]))
    return torch.stack(coef, -1), torch.stack(mass, -1), torch.stack(r_mass, -1), torch.stack(kept, -1)


def _residual_after_all(p, r, x, px, rx, exists, coef, mass, kept) -> torch.Tensor:
    """p ``[B, V]`` once every child (``exists``, ``[B, slots]``) is rejected, from the last column of
    ``_rejection_states`` (``coef``, ``mass`` ``[B, 1]``): p less coef * r, the rejected tokens x at their kept
    values, renormalised."""
    at_last = (px - coef * rx).clamp(min=0)
    residual = (p - coef * r).clamp(min=0).scatter_add(1, x, torch.where(exists, kept - at_last, 0.0))
    return residual / mass


def _residual_coefficient(coef: torch.Tensor, mass: torch.Tensor, r_mass: torch.Tensor) -> torch.Tensor:
    """One rejection of a draw from r, per row ``[B]``: with p (unnormalised) = max(p_c - coef * r, 0) of sum
    ``mass`` and r (unnormalised) of sum ``r_mass`` where not yet rejected, the residual max(p / mass - r /
    r_mass, 0), times mass, is max(p_c - coef' * r, 0) with coef' = coef + mass / r_mass (r >= 0: subtracting
    twice is subtracting the sum); the tokens r has lost are left out of both."""
    return coef + mass / r_mass


def _remove(p: torch.Tensor, tokens: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """p ``[B, V]`` with the tokens ``[B, n]`` of the ``drop`` ``[B, n]`` nodes zeroed (the residual after
    rejecting them); a row's p itself if that leaves it no mass."""
    hit = torch.zeros(p.shape, dtype=torch.long, device=p.device).scatter_reduce(1, tokens, drop.long(), "amax")
    residual = p * (hit == 0)
    return torch.where(residual.sum(1, keepdim=True) > 0, residual, p)
