"""Logit processing (temperature, top-k, top-p) and sync-free sampling.

A rule is split in two so that one captured graph or compiled round serves many calls: ``RuleForm`` (what
the code depends on: greedy or sampling, filtered or not, which fuzzy rule) is static and keys runners;
``RuleValues`` (temperature, top-p, top-k, FSD threshold) are device tensors that a call fills in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .ops import first_argmax
from .rng import DRAW_TOKEN, RandomStream

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class RuleForm:
    """The static part of an acceptance rule (see verify.AcceptanceRule.form).

    greedy: argmax rules (temperature 0); filtered: top-k or top-p filtering (one sort of each distribution
    that is sampled); fuzzy: the FSD test is active (the draft's distributions are kept and the divergence
    ``divergence`` computed, ``mode`` hybrid or pure, ``support_top_k``, on ``processed`` distributions);
    sampled_children: the tree's children are drawn from the draft and verified by recursive rejection
    sampling without replacement (the exact sampling rule only).
    """

    greedy: bool = True
    filtered: bool = False
    fuzzy: bool = False
    divergence: str = "kl"
    mode: str = "hybrid"
    support_top_k: int = 0
    processed: bool = False
    sampled_children: bool = False

    def exact(self) -> "RuleForm":
        """This form without the fuzzy test (what plain autoregressive decoding needs)."""
        return RuleForm(self.greedy, self.filtered)


@dataclass
class RuleValues:
    """The numbers of a rule for B rows as ``[B]`` float32 device tensors, set in place per call (``set``,
    ``set_row``), so that captured graphs and compiled rounds read them by address: temperature, top_p,
    top_k (0: no top-k) and the FSD threshold T (may be +inf)."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    threshold: torch.Tensor

    @classmethod
    def create(cls, device: torch.device | str, batch: int = 1) -> "RuleValues":
        return cls(*(torch.zeros(batch, dtype=torch.float32, device=device) for _ in range(4)))

    def set(self, rule, row: int | None = None) -> None:
        """Copy an AcceptanceRule's numbers into ``row`` (default: every row); fills of device tensors, no
        host sync."""
        rows = slice(None) if row is None else row
        s = rule.sampling
        self.temperature[rows].fill_(s.temperature if s.temperature > 0 else 1.0)
        self.top_p[rows].fill_(s.top_p)
        self.top_k[rows].fill_(s.top_k)
        # A threshold beyond float32's range accepts whatever inf accepts (divergences are float32).
        t = rule.fuzzy.threshold
        self.threshold[rows].fill_(t if t <= FLOAT32_MAX else math.inf)

    def tensors(self) -> list[torch.Tensor]:
        return [self.temperature, self.top_p, self.top_k, self.threshold]

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every tensor with its batch dimension (0; see ``decode.mark_batch_dynamic``)."""
        return [(t, 0) for t in self.tensors()]


def per_row(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A ``[B]`` value shaped to broadcast against ``like`` ``[B, ...]``."""
    return value.view((-1,) + (1,) * (like.dim() - 1))


def process_logits(logits: torch.Tensor, form: RuleForm, values: RuleValues) -> torch.Tensor:
    """``[B, ..., V]`` float32 logits (row b under values' row b) -> logits of the distribution actually sampled (filtered entries are -inf).

    Greedy forms return the logits unchanged (argmax is unaffected by temperature, top-k and top-p).
    Filtering sorts each row once: top-k keeps the tokens at least as likely as the k-th (ties kept), then
    top-p drops a token when the mass strictly before it, within what top-k kept, already reaches top_p
    (the top token always stays); top_p = 1 and top_k = 0 keep everything.
    """
    if form.greedy:
        return logits
    logits = logits / per_row(values.temperature, logits)
    if not form.filtered:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k, top_p = per_row(values.top_k, logits), per_row(values.top_p, logits)
    k = top_k.long().clamp(min=1, max=logits.shape[-1]) - 1
    kth = sorted_logits.gather(-1, k.expand(*logits.shape[:-1], 1))
    keep_k = (top_k <= 0) | (sorted_logits >= kth)
    probs = sorted_logits.masked_fill(~keep_k, float("-inf")).softmax(-1)
    drop_sorted = ~keep_k | ((probs.cumsum(-1) - probs >= top_p) & (top_p < 1.0))
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(probs: torch.Tensor, rng: RandomStream, draw: int) -> torch.Tensor:
    """Draw one index per distribution of ``[B, ..., V]`` (unnormalized, non-negative) weights without a host
    sync: argmax of w / E with E ~ Exp(1) (the exponential race) picks i with probability w_i / sum w.
    E = -log U with U from ``rng``'s draw ``draw`` at each row's current step. Returns ``[B, ...]``. The
    argmax is ``first_argmax``: the same token as argmax, with the race spread over many GPU blocks."""
    race = -torch.log(rng.uniform(tuple(probs.shape[1:]), draw))
    return first_argmax(probs.float() / race)


def choose(logits: torch.Tensor, form: RuleForm, values: RuleValues, rng: RandomStream | None) -> torch.Tensor:
    """The target's next token from raw logits ``[B, ..., V]``: argmax when greedy, else a sample of p."""
    if form.greedy:
        return logits.argmax(dim=-1)
    return sample(process_logits(logits, form, values).softmax(-1), rng, DRAW_TOKEN)
