"""eval/multidraft.py: the acceptance of a node's children under sampling, deterministic top-k against children
sampled without replacement (recursive rejection sampling without replacement). The sampled rule must be
lossless (its output distributed as the target's p: a chi-square test, which an output taken from the proposal
instead fails), and the acceptance figures must be what they claim."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.multidraft import (deterministic_acceptance, lumped, measure, rrsw, sampled_acceptance,  # noqa: E402
                             teacher_forced, truncated)
from fsd_eagle.head import EagleHead, HeadConfig  # noqa: E402

from conftest import tiny_model  # noqa: E402
from test_eagle3 import reference_logits  # noqa: E402

CHI2_DF5_P001 = 20.52  # chi-square quantile: 5 degrees of freedom, p = 0.001


def chi_square(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_children_rule_is_lossless_and_the_test_has_power():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05])
    r = torch.tensor([0.05, 0.10, 0.40, 0.25, 0.15, 0.05])  # a proposal far from p
    for k in (1, 2, 3):
        accepted, out = rrsw(p, r, k, draws=40000, generator=g)
        assert chi_square(out, p) < CHI2_DF5_P001, k
        assert 0 < float(accepted.float().mean()) < 1
    # the proposal's own samples (no rejection) are far from p: the same test rejects them
    wrong = torch.multinomial(r, 40000, replacement=True, generator=g)
    assert chi_square(wrong, p) > CHI2_DF5_P001


def test_acceptance_figures():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q_logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])  # the head's order: 1, 2, 3, 0
    assert torch.allclose(deterministic_acceptance(p, q_logits, 1), torch.tensor([0.3]))
    assert torch.allclose(deterministic_acceptance(p, q_logits, 2), torch.tensor([0.5]))
    g = torch.Generator().manual_seed(1)
    # a proposal equal to p is always accepted; k = V candidates always hold an accepted one
    assert float(sampled_acceptance(p, p.clone(), 1, 2000, g)[0]) == 1.0
    r = torch.tensor([[0.1, 0.1, 0.1, 0.7]])
    assert float(sampled_acceptance(p, r, 4, 2000, g)[0]) == 1.0
    # one candidate from r is accepted with probability 1 - TV(p, r) = sum min(p, r) = 0.3
    assert abs(float(sampled_acceptance(p, r, 1, 20000, g)[0]) - 0.3) < 0.02


def test_measure_reports_every_k_on_the_same_rows():
    g = torch.Generator().manual_seed(2)
    p_logits, q_logits = torch.randn(50, 40, generator=g) * 2, torch.randn(50, 40, generator=g) * 2
    out = measure(p_logits, q_logits, temperature=0.7, positions=20, draws=32, seed=3)
    assert out["positions"] == 20
    for k in (1, 2, 4, 8):
        assert 0 <= out[f"deterministic_{k}"] <= 1 and 0 <= out[f"sampled_{k}"] <= 1
    assert out["deterministic_8"] >= out["deterministic_1"]


def test_children_drawn_from_the_whole_top_m_are_the_deterministic_set():
    """k children drawn without replacement from the head's top k alone are that set in a random order: the
    lossless rule then accepts them exactly as often as the deterministic top k (the target's mass on them);
    from a wider top m the set varies and is accepted more often here (p close to the proposal)."""
    g = torch.Generator().manual_seed(4)
    q_logits = torch.randn(6, 30, generator=g) * 2
    p = torch.softmax(q_logits + 0.3 * torch.randn(6, 30, generator=g), -1)
    r = torch.softmax(q_logits, -1)
    top3 = truncated(r, 3)
    assert torch.allclose(top3.sum(1), torch.ones(6)) and ((top3 > 0).sum(1) == 3).all()
    assert torch.equal(top3.topk(3).indices.sort().values, r.topk(3).indices.sort().values)
    det = deterministic_acceptance(p, q_logits, 3)
    assert torch.allclose(sampled_acceptance(p, top3, 3, 4000, g), det, atol=0.03)
    assert float(sampled_acceptance(p, truncated(r, 12), 3, 4000, g).mean()) > float(det.mean()) + 0.05


def test_measure_reports_truncated_proposals_for_k_up_to_m():
    g = torch.Generator().manual_seed(5)
    p_logits, q_logits = torch.randn(30, 40, generator=g) * 2, torch.randn(30, 40, generator=g) * 2
    out = measure(p_logits, q_logits, temperature=0.7, positions=10, draws=16, seed=3, truncate=(2, 8))
    assert {k for k in out if "_top" in k} == {"sampled_1_top2", "sampled_2_top2", "sampled_1_top8", "sampled_2_top8",
                                               "sampled_4_top8", "sampled_8_top8"}


def test_a_lumped_pool_is_accepted_as_the_whole_vocabulary():
    """Children from the head's top m, with the target's mass off them as one entry, are accepted as often as
    over the whole vocabulary (the same proposal, truncated); a colder or warmer proposal is measured too."""
    g = torch.Generator().manual_seed(6)
    q_logits = torch.randn(8, 60, generator=g) * 2
    p = torch.softmax(q_logits + 0.5 * torch.randn(8, 60, generator=g), -1)
    pool_p, pool_r = lumped(p, q_logits, 6, 1.0)
    assert pool_p.shape == (8, 7) and torch.allclose(pool_p.sum(1), torch.ones(8)) and (pool_r[:, -1] == 0).all()
    whole = sampled_acceptance(p, truncated(torch.softmax(q_logits, -1), 6), 3, 6000, g)
    assert torch.allclose(sampled_acceptance(pool_p, pool_r, 3, 6000, g), whole, atol=0.03)
    out = measure(q_logits + 0.5, q_logits, temperature=0.7, positions=8, draws=16, seed=3, truncate=(6,),
                  proposal_temperatures=(0.5, 1.0))
    assert {"sampled_2_top6", "sampled_2_top6_t0.5", "sampled_2_top6_t1", "sampled_2"} <= set(out)
    pools = measure(q_logits + 0.5, q_logits, temperature=0.7, positions=8, draws=16, seed=3, truncate=(6,),
                    whole=False)
    assert "sampled_2" not in pools and "sampled_2_top6" in pools and "deterministic_2" in pools


class _ChatTok:
    """A tokenizer stand-in whose chat template is a fixed prompt of token ids."""

    ids = [5, 17, 99, 3, 42, 64, 8]

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=True):
        return list(self.ids)


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_teacher_forced_logits_are_the_targets_and_the_heads_first_draft(arch):
    """At each answer position of the target's sampled answer: p is the target's next-token logits, q the
    head's draft logits for the same token after the committed prefix (EAGLE-2 drafting's first level), for an
    EAGLE-2-style head (through the target's lm_head) and an EAGLE-3 head (its own vocabulary, -inf
    elsewhere)."""
    model = tiny_model("llama", seed=0, num_hidden_layers=4)
    torch.manual_seed(2)
    head = EagleHead(HeadConfig.for_target(model.config, arch=arch,
                                           **({"draft_vocab_size": 100} if arch == "eagle3" else {}))).float().eval()
    if arch == "eagle3":
        ids = torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(1))[:100].sort().values
        head.d2t.copy_(ids - torch.arange(100))
        head.t2d.copy_(torch.zeros(model.config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True))
    p, q = teacher_forced(model, _ChatTok(), head, ["x"], 0.9, 6, seed=3)
    torch.manual_seed(3)
    prompt = torch.tensor([_ChatTok.ids])
    with torch.no_grad():
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=0.9,
                             top_k=0, top_p=1.0, max_new_tokens=6)[0]
        logits = model(out[None]).logits[0]
    first = len(_ChatTok.ids) - 2
    assert p.shape == q.shape == (out.shape[0] - 2 - first, model.config.vocab_size)
    for j in range(p.shape[0]):
        t = first + j
        torch.testing.assert_close(p[j], logits[t + 1], atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            if arch == "eagle3":
                want = torch.full((model.config.vocab_size,), float("-inf"))
                want[head.draft_ids()] = reference_logits(head, model, out[: t + 1], out[t + 1: t + 2])
            else:
                hs = model.model(out[None, : t + 1]).last_hidden_state
                f = head(model.get_input_embeddings()(out[1: t + 2])[None], hs, torch.arange(t + 1)[None])[0, -1]
                want = model.lm_head(f)
        torch.testing.assert_close(q[j], want, atol=1e-4, rtol=1e-4)
