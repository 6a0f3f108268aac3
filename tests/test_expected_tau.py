"""eval/expected_tau.py: the expected accepted length of a tree under the exact sampling rule, and the walk
along an answer that feeds it (target distributions at the tree's nodes, position after position)."""

from __future__ import annotations

import torch
from conftest import ancestors, reference_probs, verify

from eval import expected_tau
from eval.expected_tau import expected_accepted, walk_answer
from fsd_eagle.api import SpeculativeGenerator
from fsd_eagle.config import SamplingConfig, TreeConfig
from fsd_eagle.head import EagleHead, HeadConfig
from fsd_eagle.rng import RandomStream
from fsd_eagle.tree import DraftTree, draft_tree
from fsd_eagle.verify import AcceptanceRule
from test_api import PROMPT, make_llama, make_tokenizer


def _tree(rows: int) -> DraftTree:
    """A hand-made tree of 8 nodes over a 6-token vocabulary, repeated over ``rows`` batch rows: the root has
    three children (tokens 2, 4, 0), node 1 two (1, 3), node 4 one (5), node 2 one (2)."""
    tokens = torch.tensor([3, 2, 4, 0, 1, 3, 5, 2])
    parents = torch.tensor([0, 0, 0, 0, 1, 1, 4, 2])
    n = tokens.shape[0]
    anc = ancestors(parents)
    depths = anc.sum(1) - 1
    expand = lambda t: t.expand(rows, *t.shape).clone()  # noqa: E731
    return DraftTree(expand(tokens), expand(parents), expand(depths), expand(anc), torch.zeros(rows, n), None,
                     torch.full((rows, n), -1), int(depths.max()))


def test_expected_accepted_is_the_mean_accepted_length_of_the_sampling_rule():
    """The formula against the library's verifier: 24,000 sampled verdicts of one tree (top children, exact
    rule, T = 0.8, top-p 0.95) accept on average what expected_accepted says, within 4 standard errors; a
    sharper target accepts more (the comparison is not vacuous)."""
    logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)) * 1.5
    rows, steps = 400, 60
    tree = _tree(rows)
    exacts = {}
    for temperature, top_p in ((0.8, 0.95), (0.4, 1.0)):
        rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p))
        probs = reference_probs(logits, temperature, top_p).float()
        exact = float(expected_accepted(_tree(1), probs[None])[0])
        rng = RandomStream.create("cpu", batch=rows)
        for row in range(rows):
            rng.reseed(11 * rows + row, row)
        accepted = []
        for _ in range(steps):
            verdict = verify(tree, logits.expand(rows, *logits.shape), rule, rng)
            rng.advance()
            accepted.append(verdict.n_accepted.double() - 1)
        accepted = torch.cat(accepted)
        se = float(accepted.std()) / accepted.numel() ** 0.5
        assert abs(float(accepted.mean()) - exact) < 4 * se, (temperature, float(accepted.mean()), exact, se)
        exacts[temperature] = exact
    assert exacts[0.4] > exacts[0.8] + 0.1


def test_walking_an_answer_sees_the_targets_distributions_at_every_position(monkeypatch):
    """Every tree the walk scores is rooted at the answer's token of its position, is the tree that a
    drafter prefilled from scratch over prompt + answer so far drafts there, and its nodes' target
    distributions (at the rule's temperature) are those of a plain forward of the model over prompt +
    answer so far + the node's path: the caches and the drafter advance one committed token at a time."""
    model, tokenizer = make_llama(seed=0), make_tokenizer()
    torch.manual_seed(4)
    head = EagleHead(HeadConfig.for_target(model.config)).eval()
    gen = SpeculativeGenerator(model, tokenizer, head=head)
    prompt_ids = gen.encode(PROMPT)
    answer = gen.generate(PROMPT, 6, temperature=0.9, seed=2, autoregressive=True).token_ids
    seen = []
    real = expected_tau.expected_accepted
    monkeypatch.setattr(expected_tau, "expected_accepted", lambda tree, probs: seen.append((tree, probs)) or
                        real(tree, probs))
    trees = [TreeConfig(total_tokens=5, depth=3, top_k=2), TreeConfig(total_tokens=3, depth=2, top_k=1)]
    rule = AcceptanceRule(SamplingConfig(temperature=0.9))
    walked = walk_answer(gen, prompt_ids, answer, trees, rule)
    assert [len(v) for v in walked.values()] == [len(answer) - 1] * 2
    assert len(seen) == 2 * (len(answer) - 1)
    for call, (tree, probs) in enumerate(seen):
        t = call // 2
        assert int(tree.tokens[0, 0]) == answer[t]
        for node in range(tree.size):
            path = tree.tokens[0, tree.anc[0, node]].tolist()
            ids = torch.tensor(prompt_ids + answer[:t] + path)[None]
            want = reference_probs(model(ids).logits[0, -1].detach(), 0.9, 1.0).float()
            torch.testing.assert_close(probs[0, node], want, rtol=1e-4, atol=1e-5)
        assert float(walked[trees[call % 2]][t]) == float(real(tree, probs)[0])
    fresh = gen.engine.new_drafter(gen.engine.target)
    for t in range(len(answer) - 1):  # the drafter: the walk's trees against trees drafted from scratch
        ids = torch.tensor(prompt_ids + answer[: t + 1])
        gen.target.allocate(ids.shape[0] + 8)
        features = gen.target.prefill(ids[None, :-1])
        fresh.allocate(ids.shape[0] + 8, TreeConfig(total_tokens=2, depth=3, top_k=2))
        root = fresh.prefill(ids[None], features)
        want = draft_tree(fresh, ids[-1:], root.logits, root.state, trees[0])
        assert torch.equal(seen[2 * t][0].tokens, want.tokens) and torch.equal(seen[2 * t][0].parents, want.parents)
