"""Tests of the Fuzzy Speculative Decoding (FSD) acceptance rule in fsd_eagle.verify and its wiring through
decode and the API.

Symbols: at tree node n, p_n is the target's distribution (row n of the verify logits) and q_n the draft's
(``DraftTree.q_logits[q_row[n]]``); D = D(p_n, q_n); T the threshold. hybrid = the exact rule, or else the
draft's top child when D <= T; pure = the draft's top child iff D <= T. T = 0 hybrid is exactly EAGLE-2.

Fast: tiny random Llama targets (vocab 128) and a noisy copy as the drafter, CPU, float32.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import FuzzyConfig, SamplingConfig, TreeConfig, parse_threshold
from fsd_eagle.divergence import DIVERGENCES, divergence
from fsd_eagle.errors import ConfigError, FSDError
from fsd_eagle.tree import DraftTree
from fsd_eagle.verify import AcceptanceRule, Verdict

import conftest
from conftest import decode_all, make_session
from test_api import make_llama, noisy_copy  # noisy_copy: a drafter that agrees with the target often

torch.set_num_threads(1)  # tiny matmuls: threads only add contention

VOCAB = 128
INF = math.inf
T_GRID = [0.0, 1e-4, 1e-3, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 2.0, 5.0, 20.0, 100.0, INF]
CHAIN = TreeConfig(total_tokens=5, depth=4, top_k=1)
BRANCHY = TreeConfig(total_tokens=12, depth=4, top_k=3)
GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=0.8)


# ----------------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="module")
def target_model():
    return make_llama(seed=0)


@pytest.fixture(scope="module")
def draft_model(target_model):
    return noisy_copy(target_model, 0.01)


@pytest.fixture(scope="module")
def prompt():
    return torch.tensor([5, 17, 99, 3, 42, 64, 8, 120, 77, 31])


def run_decode(model, draft, prompt_ids, n, tree, rule, seed=0):
    """Plain ids of one decode call and its stats (a fresh session every call)."""
    out, stats = decode_all(make_session(model, tree, rule, draft_model=draft), prompt_ids, n, rule, seed)
    assert len(out) == n == stats.new_tokens
    return out, stats


def _stack(tree: DraftTree, rows: int) -> DraftTree:
    """``rows`` batch rows of one unbatched tree."""
    fields = [getattr(tree, name) for name in ("tokens", "parents", "depths", "anc", "scores", "q_logits", "q_row")]
    return DraftTree(*(None if x is None else x.expand(rows, *x.shape) for x in fields), max_depth=tree.max_depth)


def verify(tree: DraftTree, logits: torch.Tensor, rule: AcceptanceRule, seed: int | None = None):
    """The verdict of one unbatched tree ``[n]`` under logits ``[n, V]`` (a seed for sampling rules), without
    the batch dimension. Checks it is the verdict the tree gets as row 0 of a batch of two whose row 1 has
    other logits (exactly, but for float rounding of the divergences between batch shapes)."""
    one = conftest.verify(_stack(tree, 1), logits[None], rule, seed)
    two = conftest.verify(_stack(tree, 2), torch.stack([logits, logits.roll(1, -1)]), rule, seed)
    names = [f.name for f in dataclasses.fields(Verdict)]
    for name in names:
        tol = 1e-5 if name == "div_sum" else 0
        torch.testing.assert_close(getattr(two, name)[0], getattr(one, name)[0], rtol=tol, atol=tol, msg=name)
    return Verdict(*(getattr(one, name)[0] for name in names))


@torch.no_grad()
def reference_greedy(model, prompt_ids, n):
    """Plain AR loop: the full sequence re-run every step, argmax of the last logits."""
    ids = prompt_ids[None].clone()
    for _ in range(n):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, prompt_ids.shape[0]:].tolist()


# ------------------------------------------------------------------- (a) T = 0 hybrid is EAGLE-2

N_NEW = 24


@pytest.fixture(scope="module")
def reference(target_model, prompt):
    return reference_greedy(target_model, prompt, N_NEW)


def test_drafter_is_accepted_sometimes(target_model, draft_model, prompt, reference):
    """Precondition of the equality tests: the noisy drafter is accepted often but not always."""
    out, stats = run_decode(target_model, draft_model, prompt, N_NEW, CHAIN, AcceptanceRule())
    assert out == reference
    assert stats.tau > 1.3
    assert any(a < CHAIN.depth + 1 for a in stats.accept_lengths)
    assert stats.fuzzy_accepted == 0


@pytest.fixture(scope="module")
def exact_runs(target_model, draft_model, prompt):
    """Exact EAGLE-2 (default rule) and plain AR decoding per tree shape."""
    return {name: (run_decode(target_model, draft_model, prompt, N_NEW, tree, AcceptanceRule()),
                   run_decode(target_model, None, prompt, N_NEW, tree, AcceptanceRule()))
            for name, tree in (("chain", CHAIN), ("tree", BRANCHY))}


@pytest.mark.parametrize("tree", [CHAIN, BRANCHY], ids=["chain", "tree"])
@pytest.mark.parametrize("div", DIVERGENCES)
def test_hybrid_t0_greedy_equals_exact_and_reference(target_model, draft_model, prompt, reference, exact_runs,
                                                      tree, div):
    (exact, exact_stats), (ar, ar_stats) = exact_runs["chain" if tree is CHAIN else "tree"]
    for top_k in (0, 5):
        rule = AcceptanceRule(GREEDY, FuzzyConfig(threshold=0.0, divergence=div, support_top_k=top_k))
        out, stats = run_decode(target_model, draft_model, prompt, N_NEW, tree, rule)
        assert out == exact == ar == reference
        assert stats.accept_lengths == exact_stats.accept_lengths
        assert stats.fuzzy_accepted == 0
    assert ar_stats.target_forwards == N_NEW
    assert exact_stats.target_forwards < N_NEW


@pytest.mark.parametrize("div", ["kl", "js", "tv"])
def test_threshold_below_every_divergence_is_exact(target_model, draft_model, prompt, reference, div):
    """A T > 0 smaller than every D runs the whole fuzzy code path yet must not change a single token."""
    rule = AcceptanceRule(GREEDY, FuzzyConfig(threshold=1e-12, divergence=div))
    out, stats = run_decode(target_model, draft_model, prompt, N_NEW, BRANCHY, rule)
    assert out == reference
    assert stats.divergence_count > 0 and stats.divergence_mean > 1e-12
    assert stats.fuzzy_accepted == 0


# ------------------------------------------------------------------------ hand-built draft trees


def build_tree(seed: int, depth: int = 4, vocab: int = 16, chain_only: bool = False):
    """A random depth-ordered draft tree built like EAGLE-2's: each expanded node draws q logits, its children
    are the top tokens of q and their scores the cumulative log q. The top-1 chain always reaches ``depth``.
    Returns the tree, the top-1 chain's node indices and target logits [n, vocab] that partly follow q."""
    g = torch.Generator().manual_seed(seed)
    # nodes as (token, parent, depth, score, q_logits or None, on_top_chain)
    nodes = [[int(torch.randint(vocab, (1,), generator=g)), 0, 0, 0.0, None, True]]
    level = [0]
    for d in range(1, depth + 1):
        new = []
        for idx in level:
            node = nodes[idx]
            on_chain = node[5]
            if not on_chain and (chain_only or torch.rand((), generator=g) < 0.4):
                continue
            q = 3.0 * torch.randn(vocab, generator=g)
            node[4] = q
            n_children = 1 if chain_only else int(torch.randint(0 if not on_chain else 1, 4, (), generator=g))
            logq = torch.log_softmax(q, -1)
            top = logq.topk(max(n_children, 1)).indices[:n_children]
            for rank, tok in enumerate(top.tolist()):
                new.append([tok, idx, d, node[3] + float(logq[tok]), None, on_chain and rank == 0])
        new.sort(key=lambda x: -x[3])
        first = len(nodes)
        nodes.extend(new)
        level = list(range(first, len(nodes)))
    # A leaf may still have been expanded (drafted, children cut by reranking): give a few a q row.
    for node in nodes:
        if node[4] is None and not chain_only and torch.rand((), generator=g) < 0.3:
            node[4] = 3.0 * torch.randn(vocab, generator=g)
    n = len(nodes)
    parents = torch.tensor([x[1] for x in nodes])
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        anc[i] = anc[parents[i]].clone()
        anc[i, i] = True
    q_rows, q_row = [], []
    for x in nodes:
        if x[4] is None:
            q_row.append(-1)
        else:
            q_row.append(len(q_rows))
            q_rows.append(x[4])
    tree = DraftTree(tokens=torch.tensor([x[0] for x in nodes]), parents=parents,
                     depths=torch.tensor([x[2] for x in nodes]), anc=anc,
                     scores=torch.tensor([x[3] for x in nodes], dtype=torch.float32),
                     q_logits=torch.stack(q_rows), q_row=torch.tensor(q_row), max_depth=depth)
    chain = [i for i, x in enumerate(nodes) if x[5]]
    # Target logits: a mix of the node's q (so argmaxes and small D happen) and noise.
    logits = torch.empty(n, vocab)
    for i, x in enumerate(nodes):
        noise = 3.0 * torch.randn(vocab, generator=g)
        mix = float(torch.rand((), generator=g))
        logits[i] = noise if x[4] is None else mix * x[4] + (1 - mix) * noise
    return tree, chain, logits


def check_path(tree: DraftTree, verdict) -> list[int]:
    """The verdict's path is a root path of n_accepted nodes padded with its last node; returns it."""
    n_acc = int(verdict.n_accepted)
    path = verdict.path.tolist()
    assert len(path) == tree.max_depth + 1 and 1 <= n_acc <= tree.max_depth + 1
    assert path[0] == 0
    for i in range(1, n_acc):
        assert int(tree.parents[path[i]]) == path[i - 1]
    assert all(x == path[n_acc - 1] for x in path[n_acc:])
    return path[:n_acc]


def reference_greedy_length(tree: DraftTree, logits, fuzzy: FuzzyConfig) -> int:
    """Longest root path whose every node is accepted: node c with parent n is ok iff (hybrid) c's token is
    argmax p_n, or c is n's top child (highest score) and D(p_n, q_n) <= T."""
    n = tree.tokens.shape[0]  # an unbatched tree
    d = divergence(fuzzy.divergence, logits, tree.q_logits[tree.q_row.clamp(min=0)], fuzzy.support_top_k)
    best = 1
    ok = [True] * n
    for c in range(1, n):
        par = int(tree.parents[c])
        siblings = [s for s in range(1, n) if int(tree.parents[s]) == par]
        is_top = float(tree.scores[c]) == max(float(tree.scores[s]) for s in siblings)
        fuzzy_ok = is_top and int(tree.q_row[par]) >= 0 and float(d[par]) <= fuzzy.threshold
        exact_ok = int(tree.tokens[c]) == int(logits[par].argmax())
        ok[c] = ok[par] and (fuzzy_ok if fuzzy.mode == "pure" else exact_ok or fuzzy_ok)
        if ok[c]:
            best = max(best, int(tree.depths[c]) + 1)
    return best


TREE_SEEDS = range(8)


@pytest.mark.parametrize("mode", ["hybrid", "pure"])
@pytest.mark.parametrize("div", DIVERGENCES)
def test_greedy_acceptance_monotonic_in_threshold(div, mode):
    lengths_seen = set()
    for seed in TREE_SEEDS:
        tree, chain, logits = build_tree(seed)
        exact = verify(tree, logits, AcceptanceRule())
        for support in (0, 3):
            previous = 0
            for t in T_GRID:
                fuzzy = FuzzyConfig(threshold=t, divergence=div, mode=mode, support_top_k=support)
                v = verify(tree, logits, AcceptanceRule(GREEDY, fuzzy))
                path = check_path(tree, v)
                n_acc = int(v.n_accepted)
                lengths_seen.add(n_acc)
                assert n_acc >= previous, (seed, support, t)
                previous = n_acc
                assert n_acc == reference_greedy_length(tree, logits, fuzzy), (seed, support, t)
                assert int(v.bonus) == int(logits[path[-1]].argmax())
                assert int(v.fuzzy_extra) >= 0
                if mode == "hybrid":
                    assert n_acc >= int(exact.n_accepted)
                    assert int(v.fuzzy_extra) == n_acc - int(exact.n_accepted)
                if t == INF:
                    # Every top child passes: the whole top-1 chain (it reaches max_depth) is accepted.
                    assert n_acc == tree.max_depth + 1
                    if mode == "pure":
                        assert path == chain
    assert len(lengths_seen) > 2  # the trees really exercise different outcomes


def test_hybrid_t0_verdict_equals_exact_on_trees():
    for seed in TREE_SEEDS:
        tree, _, logits = build_tree(seed)
        exact = verify(tree, logits, AcceptanceRule())
        for div in DIVERGENCES:
            v = verify(tree, logits, AcceptanceRule(GREEDY, FuzzyConfig(threshold=0.0, divergence=div)))
            assert v.path.tolist() == exact.path.tolist()
            assert int(v.n_accepted) == int(exact.n_accepted) and int(v.bonus) == int(exact.bonus)
            assert int(v.fuzzy_extra) == 0


# --------------------------------------------------------------- (c) hand-made fuzzy_extra cases


def chain_tree(tokens, q_logits, q_row):
    n = len(tokens)
    idx = torch.arange(n)
    anc = idx.unsqueeze(1) >= idx.unsqueeze(0)
    scores = [0.0]
    for i in range(1, n):
        scores.append(scores[-1] + float(torch.log_softmax(q_logits[q_row[i - 1]], -1)[tokens[i]]))
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.clamp(idx - 1, min=0), depths=idx, anc=anc,
                     scores=torch.tensor(scores), q_logits=q_logits, q_row=torch.tensor(q_row), max_depth=n - 1)


def onehot_logits(v, pairs, vocab=8):
    row = torch.zeros(vocab)
    for tok, val in pairs:
        row[tok] = val
    return row


@pytest.fixture
def handmade():
    """Chain root(0) -> a(1) -> b(2) -> c(3); the draft's top child at each node is the next chain token.

    Target: at the root argmax 1 (exact accepts a); at a the argmax is 4 (exact rejects b) but p_a and q_a
    are close (2 and 4 nearly tied in both); at b the argmax is 3 (exact accepts c); at c the argmax is 5.
    """
    q = torch.stack([onehot_logits(8, [(1, 3.0), (6, 1.0)]),
                     onehot_logits(8, [(2, 2.0), (4, 1.9)]),
                     onehot_logits(8, [(3, 3.0), (7, 2.5)])])
    tree = chain_tree([0, 1, 2, 3], q, [0, 1, 2, -1])
    p = torch.stack([onehot_logits(8, [(1, 2.0), (6, 1.5)]),
                     onehot_logits(8, [(2, 1.9), (4, 2.0)]),
                     onehot_logits(8, [(3, 4.0), (7, 0.5)]),
                     onehot_logits(8, [(5, 3.0)])])
    d = divergence("kl", p, q[tree.q_row.clamp(min=0)])
    return tree, p, d


def below(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(0)))


def test_handmade_divergence_order(handmade):
    _, _, d = handmade
    assert 0 < d[1] < d[0] < d[2]  # D_a < D_root < D_b, as the cases below assume


def test_handmade_hybrid_fuzzy_extra(handmade):
    tree, p, d = handmade
    d_root, d_a, d_b = (float(x) for x in d[:3])
    rule = lambda t: AcceptanceRule(GREEDY, FuzzyConfig(threshold=t))  # noqa: E731
    # Exact: root -> a, then b is not argmax p_a = 4: bonus 4.
    for t in (0.0, below(d_a)):
        v = verify(tree, p, rule(t))
        assert (int(v.n_accepted), int(v.bonus), int(v.fuzzy_extra)) == (2, 4, 0)
        assert v.path.tolist() == [0, 1, 1, 1]
    # T = D_a (the boundary, D <= T) and more: b is taken fuzzily, c exactly; both count as extra.
    for t in (d_a, d_root, d_b, INF):
        v = verify(tree, p, rule(t))
        assert (int(v.n_accepted), int(v.bonus), int(v.fuzzy_extra)) == (4, 5, 2)
        assert v.path.tolist() == [0, 1, 2, 3]
        assert int(v.div_count) == 3  # root, a, b decided; c (never expanded) has no D
        assert float(v.div_sum) == pytest.approx(d_root + d_a + d_b, rel=1e-5)


def test_handmade_pure_bonus_and_extra(handmade):
    tree, p, d = handmade
    d_root, d_a, d_b = (float(x) for x in d[:3])
    rule = lambda t: AcceptanceRule(GREEDY, FuzzyConfig(threshold=t, mode="pure"))  # noqa: E731
    cases = [  # threshold -> (n_accepted, bonus = argmax p at the stop node, fuzzy_extra vs exact's 2)
        (0.0, (1, 1, 0)), (d_a, (1, 1, 0)), (below(d_root), (1, 1, 0)),  # pure accepts less: 0 extra, not < 0
        (d_root, (3, 3, 1)), (below(d_b), (3, 3, 1)),  # stops at b though exact accepts c there
        (d_b, (4, 5, 2)), (INF, (4, 5, 2)),
    ]
    for t, expected in cases:
        v = verify(tree, p, rule(t))
        assert (int(v.n_accepted), int(v.bonus), int(v.fuzzy_extra)) == expected, t


def test_pure_bonus_is_argmax_of_p_not_the_draft():
    """q_root = p_root (D = 0: accepted even at T = 0 in pure mode); at a the draft wants 2, p wants 4."""
    q = torch.stack([onehot_logits(8, [(1, 3.0)]), onehot_logits(8, [(2, 5.0)])])
    p = torch.stack([onehot_logits(8, [(1, 3.0)]), onehot_logits(8, [(4, 5.0)]), onehot_logits(8, [(6, 5.0)])])
    tree = chain_tree([0, 1, 2], q, [0, 1, -1])
    v = verify(tree, p, AcceptanceRule(GREEDY, FuzzyConfig(threshold=0.0, mode="pure")))
    assert (int(v.n_accepted), int(v.bonus)) == (2, 4)
    v = verify(tree, p, AcceptanceRule(GREEDY, FuzzyConfig(threshold=INF, mode="pure")))
    assert (int(v.n_accepted), int(v.bonus)) == (3, 6)


def test_pure_sampling_bonus_is_drawn_from_p():
    """Pure mode rejects the root's child a (D > T) although p puts almost all mass on it: the bonus comes
    from p itself (so it is a), not from the exact rule's residual (which excludes a)."""
    q = torch.stack([onehot_logits(8, [(1, 1.0)])])
    p = torch.stack([onehot_logits(8, [(1, 30.0)]), onehot_logits(8, [(3, 1.0)])])
    tree = chain_tree([0, 1], q, [0, -1])
    rule = AcceptanceRule(SAMPLED, FuzzyConfig(threshold=1e-6, mode="pure"))
    for seed in range(10):
        v = verify(tree, p, rule, seed)
        assert (int(v.n_accepted), int(v.bonus), int(v.fuzzy_extra)) == (1, 1, 0)


def test_processed_divergence_uses_the_sampled_distributions():
    """processed=True measures D on the temperature / top-k filtered distributions: with top_k = 1 both are
    one-hot on the same token (D = 0), while the raw ones differ (D > 0)."""
    q = torch.stack([onehot_logits(8, [(1, 3.0), (2, 2.5)])])
    p = torch.stack([onehot_logits(8, [(1, 2.0), (5, 1.9)]), onehot_logits(8, [(3, 1.0)])])
    tree = chain_tree([0, 1], q, [0, -1])
    sampling = SamplingConfig(temperature=1.0, top_k=1)
    raw = FuzzyConfig(threshold=1e-6, mode="pure", divergence="js")
    processed = FuzzyConfig(threshold=1e-6, mode="pure", divergence="js", processed=True)
    for seed in range(3):
        assert int(verify(tree, p, AcceptanceRule(sampling, raw), seed).n_accepted) == 1
        v = verify(tree, p, AcceptanceRule(sampling, processed), seed)
        assert int(v.n_accepted) == 2 and int(v.div_count) == 1 and float(v.div_sum) <= 1e-6
    # Greedy: processing is the identity, so processed and raw agree.
    for fuzzy in (raw, processed):
        assert int(verify(tree, p, AcceptanceRule(GREEDY, fuzzy)).n_accepted) == 1


# ---------------------------------------------------------------------------- (d) sampling + FSD


@pytest.mark.parametrize("mode", ["hybrid", "pure"])
@pytest.mark.parametrize("div", DIVERGENCES)
def test_sampling_t_inf_accepts_full_chain(div, mode):
    rule = AcceptanceRule(SAMPLED, FuzzyConfig(threshold=INF, divergence=div, mode=mode))
    for seed in range(6):
        tree, chain, logits = build_tree(seed, chain_only=True)
        assert chain == list(range(tree.tokens.shape[0]))
        v = verify(tree, logits, rule, seed)
        assert check_path(tree, v) == chain
        assert int(v.n_accepted) == tree.max_depth + 1
        assert 0 <= int(v.fuzzy_extra) <= tree.max_depth


def test_sampling_t0_hybrid_verdict_equals_exact():
    for seed in TREE_SEEDS:
        tree, _, logits = build_tree(seed)
        exact = verify(tree, logits, AcceptanceRule(SAMPLED), seed)
        for fuzzy in (FuzzyConfig(threshold=0.0, divergence="js"), FuzzyConfig(threshold=1e-12, divergence="tv")):
            v = verify(tree, logits, AcceptanceRule(SAMPLED, fuzzy), seed)
            assert v.path.tolist() == exact.path.tolist(), fuzzy
            assert int(v.n_accepted) == int(exact.n_accepted) and int(v.bonus) == int(exact.bonus)
            assert int(v.fuzzy_extra) == 0


def test_sampling_chain_acceptance_monotonic_with_same_draws():
    """With the same random draws, a larger T never shortens a chain's accepted prefix in hybrid mode."""
    for seed in TREE_SEEDS:
        tree, _, logits = build_tree(seed, chain_only=True)
        previous = 0
        for t in T_GRID:
            rule = AcceptanceRule(SAMPLED, FuzzyConfig(threshold=t, divergence="js"))
            v = verify(tree, logits, rule, seed)
            assert int(v.n_accepted) >= previous
            previous = int(v.n_accepted)
        assert previous == tree.max_depth + 1


@pytest.mark.parametrize("tree", [CHAIN, BRANCHY], ids=["chain", "tree"])
def test_sampling_t0_decode_unchanged(target_model, draft_model, prompt, tree):
    exact, exact_stats = run_decode(target_model, draft_model, prompt, N_NEW, tree, AcceptanceRule(SAMPLED), seed=3)
    again, _ = run_decode(target_model, draft_model, prompt, N_NEW, tree, AcceptanceRule(SAMPLED), seed=3)
    assert again == exact
    other, _ = run_decode(target_model, draft_model, prompt, N_NEW, tree, AcceptanceRule(SAMPLED), seed=4)
    assert other != exact  # the seed matters, so equality below is not vacuous
    for fuzzy in (FuzzyConfig(threshold=0.0, divergence="kl"), FuzzyConfig(threshold=0.0, divergence="tv"),
                  FuzzyConfig(threshold=1e-12, divergence="js")):
        out, stats = run_decode(target_model, draft_model, prompt, N_NEW, tree, AcceptanceRule(SAMPLED, fuzzy), seed=3)
        assert out == exact, fuzzy
        assert stats.accept_lengths == exact_stats.accept_lengths
        assert stats.fuzzy_accepted == 0


# ----------------------------------------------------------------- end to end at T = +inf (tau)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("mode", ["hybrid", "pure"])
def test_decode_t_inf_chain_accepts_everything(target_model, sampling, mode):
    """A bad drafter (an unrelated model) is still fully accepted at T = inf: tau = depth + 1 exactly when
    max_new_tokens = 1 (prefill) + rounds * (depth + 1)."""
    bad_draft = make_llama(seed=7)
    rounds, path_len = 4, CHAIN.depth + 1
    n = 1 + rounds * path_len
    rule = AcceptanceRule(sampling, FuzzyConfig(threshold=INF, divergence="js", mode=mode))
    prompt_ids = torch.tensor([9, 8, 7, 6, 5])
    out, stats = run_decode(target_model, bad_draft, prompt_ids, n, CHAIN, rule, seed=0)
    assert stats.accept_lengths == [path_len] * rounds
    assert stats.target_forwards == rounds + 1
    assert stats.tau == pytest.approx(n / (rounds + 1))
    exact, exact_stats = run_decode(target_model, bad_draft, prompt_ids, n, CHAIN, AcceptanceRule(sampling), seed=0)
    assert exact_stats.tau < 1.5  # the drafter really is bad
    if mode == "hybrid":
        assert stats.fuzzy_accepted > rounds  # most accepted drafts were not the exact rule's
    # max_new_tokens truncation: the last round's accepted tokens are cut, accept_lengths are not.
    out2, stats2 = run_decode(target_model, bad_draft, prompt_ids, n - 2, CHAIN, rule, seed=0)
    assert stats2.accept_lengths == [path_len] * rounds
    assert stats2.target_forwards == rounds + 1
    if sampling.greedy:
        assert out2 == out[: n - 2]


# ---------------------------------------------------------------------- (e) FuzzyConfig validation


@pytest.mark.parametrize("kwargs", [
    dict(threshold=-1.0), dict(threshold=-1e-9), dict(threshold=float("nan")), dict(threshold=-INF),
    dict(threshold="0.5"), dict(threshold=None), dict(threshold=True),
    dict(divergence="foo"), dict(divergence="KL"), dict(divergence=""),
    dict(mode="fuzzy"), dict(mode="Hybrid"), dict(mode=None),
    dict(support_top_k=-1), dict(support_top_k=1.5), dict(support_top_k=True),
])
def test_fuzzy_config_rejects(kwargs):
    with pytest.raises(ConfigError) as info:
        FuzzyConfig(**kwargs)
    assert isinstance(info.value, FSDError)
    assert "\n" not in str(info.value) and str(info.value)


def test_fuzzy_config_accepts():
    assert FuzzyConfig(threshold=INF).threshold == INF
    assert FuzzyConfig(threshold=0).threshold == 0
    for d in DIVERGENCES:
        FuzzyConfig(threshold=0.5, divergence=d, mode="pure", support_top_k=10, processed=True)
    assert not FuzzyConfig().active
    assert FuzzyConfig(threshold=0.1).active and FuzzyConfig(mode="pure").active


@pytest.mark.parametrize("text, value", [("inf", INF), ("INF", INF), (" infinity ", INF), ("+inf", INF),
                                         ("0", 0.0), ("0.25", 0.25), ("1e-3", 1e-3)])
def test_parse_threshold(text, value):
    assert parse_threshold(text) == value


@pytest.mark.parametrize("text", ["abc", "", "nan", "1e999", "-inf", "0.5x"])
def test_parse_threshold_rejects(text):
    with pytest.raises(ConfigError):
        FuzzyConfig(threshold=parse_threshold(text))


# -------------------------------------------------------------------- (f) stats in GenerationResult


class WordTokenizer:
    """The least a SpeculativeGenerator needs from a tokenizer when prompts are token ids."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def test_fuzzy_stats_in_result(target_model):
    gen = SpeculativeGenerator(target_model, WordTokenizer(), draft_model=make_llama(seed=7), tree=CHAIN)
    ids = [9, 8, 7, 6, 5]
    exact = gen.generate(ids, 16).to_dict()
    assert exact["fuzzy_accepted"] == 0 and exact["divergence_mean"] is None
    fuzzy = gen.generate(ids, 16, fuzzy=FuzzyConfig(threshold=INF)).to_dict()
    assert fuzzy["fuzzy_accepted"] > 0
    assert fuzzy["divergence_mean"] > 0
    assert fuzzy["tau"] > exact["tau"]
    some = gen.generate(ids, 16, fuzzy=FuzzyConfig(threshold=1.0, divergence="tv")).to_dict()
    assert some["fuzzy_accepted"] > 0  # tv <= 1 always, so T = 1 accepts every top child
    assert {"text", "new_tokens", "target_forwards", "tau", "tokens_per_s", "fuzzy_accepted"} <= set(fuzzy)


def test_fuzzy_never_replaces_the_exact_choice_for_no_gain():
    """Root with two leaf children: the draft's top child (a) and the target's argmax (b). Both reach depth
    1 under a huge T, so the exact child must win the tie (the output stays the target's own)."""
    vocab = 8
    tokens = torch.tensor([0, 3, 5])  # root, a = 3 (top draft child), b = 5 (target argmax)
    q = torch.full((1, vocab), -10.0)
    q[0, 3], q[0, 5] = 5.0, 4.0
    tree = DraftTree(tokens=tokens, parents=torch.tensor([0, 0, 0]), depths=torch.tensor([0, 1, 1]),
                     anc=torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool),
                     scores=torch.tensor([0.0, -0.1, -1.0]), q_logits=q, q_row=torch.tensor([0, -1, -1]), max_depth=1)
    logits = torch.zeros(3, vocab)
    logits[0, 5] = 3.0  # the target prefers b at the root
    logits[1, 1] = logits[2, 2] = 3.0  # bonus tokens after a (1) and after b (2)
    v = verify(tree, logits, AcceptanceRule(fuzzy=FuzzyConfig(threshold=math.inf)))
    assert int(v.n_accepted) == 2 and v.path.tolist()[:2] == [0, 2]
    assert int(v.bonus) == 2 and int(v.fuzzy_extra) == 0


def test_a_threshold_beyond_float32_decodes_as_inf():
    """T = 1e308 (a float64 the rule's float32 tensors cannot hold) decodes what T = inf decodes, rather
    than failing when the rule's numbers are set."""
    from fsd_eagle.api import SpeculativeGenerator
    from test_api import PROMPT, TREE, make_llama, make_tokenizer, noisy_copy

    model = make_llama(seed=0)
    gen = SpeculativeGenerator(model, make_tokenizer(), draft_model=noisy_copy(model, 0.3), tree=TREE)
    huge = gen.generate(PROMPT, 16, fuzzy=FuzzyConfig(threshold=1e308))
    assert huge.token_ids == gen.generate(PROMPT, 16, fuzzy=FuzzyConfig(threshold=math.inf)).token_ids
