"""eval/multidraft.py: the acceptance of a node's children under sampling, deterministic top-k against children
sampled without replacement (recursive rejection sampling without replacement). The sampled rule must be
lossless (its output distributed as the target's p: a chi-square test, which an output taken from the proposal
instead fails), and the acceptance figures must be what they claim."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eval.multidraft import deterministic_acceptance, measure, rrsw, sampled_acceptance  # noqa: E402

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
