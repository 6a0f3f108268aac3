"""Logit processing (temperature, top-k, top-p) and sync-free sampling."""

from __future__ import annotations

import torch

from .config import SamplingConfig


def process_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """``[..., V]`` float32 logits -> logits of the distribution actually sampled (filtered entries are -inf).

    Greedy configs return the logits unchanged (argmax is unaffected by temperature, top-k and top-p).
    """
    if cfg.greedy:
        return logits
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top token always stays).
        drop_sorted = probs.cumsum(-1) - probs >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row of ``[..., V]`` (unnormalized, non-negative) weights without a host sync:
    argmax of w / E with E ~ Exp(1) (the exponential race) picks i with probability w_i / sum w."""
    race = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return (probs.float() / race).argmax(dim=-1)


def choose(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The target's next token from raw logits ``[..., V]``: argmax when greedy, else a sample of p."""
    if cfg.greedy:
        return logits.argmax(dim=-1)
    return sample(process_logits(logits, cfg).softmax(-1), generator)
