"""Fidelity to the target: the target's negative log-likelihood of generated tokens.

``sequence_nll(model, prompt_ids, output_ids)`` runs the target (a stock transformers causal LM, e.g.
``SpeculativeGenerator.target.model``) once over prompt + output, without gradients and without a cache,
and returns the summed NLL (natural log, nats) of the output tokens given everything before them, with the
token count, so that a benchmark can average per token over many questions (sum of sums / sum of counts).

Token agreement with the autoregressive output is :func:`eval.metrics.token_agreement`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from fsd_eagle.errors import InputError

__all__ = ["sequence_nll", "mean_nll"]


def _accepts_logits_to_keep(model) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@torch.no_grad()
def sequence_nll(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> tuple[float, int]:
    """(sum of -log p(output[t] | prompt, output[:t]) over t, number of output tokens).

    One forward over ``prompt_ids + output_ids`` (batch 1, no padding, ``use_cache=False``); the logits are
    read in float32 (any final logit soft-capping is part of the model's own forward). Only the output
    positions' logits are kept when the model supports ``logits_to_keep``. An empty output gives (0.0, 0).
    """
    prompt, output = [int(t) for t in prompt_ids], [int(t) for t in output_ids]
    n = len(output)
    if n == 0:
        return 0.0, 0
    if not prompt:
        raise InputError("sequence_nll needs at least one prompt token (the first output token is conditioned on it)")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + output], dtype=torch.long, device=device)
    kwargs = {"use_cache": False}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = n + 1
    logits = model(input_ids=ids, **kwargs).logits[0]
    # The logits at position i predict token i + 1: the output tokens are predicted by positions P-1 .. P+n-2.
    logits = logits[-(n + 1):-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    targets = ids[0, -n:]
    nll = -logp.gather(1, targets[:, None]).squeeze(1)
    return float(nll.sum()), n


def mean_nll(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float | None:
    """Mean NLL per output token (nats), or None for an empty output."""
    total, n = sequence_nll(model, prompt_ids, output_ids)
    return total / n if n else None
