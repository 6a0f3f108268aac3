"""Fidelity to the target: the target's negative log-likelihood of generated tokens.

``sequence_nll(model, prompt_ids, output_ids)`` runs the target (a stock transformers causal LM, e.g.
``SpeculativeGenerator.target.model``) once over prompt + output, without gradients and without a cache,
and returns the summed NLL (natural log, nats) of the output tokens given everything before them, with the
token count, so that a benchmark can average per token over many questions (sum of sums / sum of counts).
``sequences_nll(model, pairs)`` does the same for many (prompt, output) pairs, several per forward (left
padded): a sweep scores each batch of finished questions in a forward or two instead of one forward each.

Token agreement with the autoregressive output is :func:`eval.metrics.token_agreement`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from fsd_eagle.errors import InputError

__all__ = ["sequence_nll", "sequences_nll", "mean_nll"]

# Logits held at once by sequences_nll: rows x kept positions x vocabulary (2^28: 512 MiB in bf16).
MAX_LOGITS = 1 << 28


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
    return sequences_nll(model, [(prompt_ids, output_ids)])[0]


@torch.no_grad()
def sequences_nll(model, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, max_rows: int = 64,
                  max_logits: int = MAX_LOGITS) -> list[tuple[float, int]]:
    """:func:`sequence_nll` of each (prompt_ids, output_ids) pair, in the order given, from forwards of up to
    ``max_rows`` sequences at once.

    Pairs are taken in order of total length, so each forward pads little; a forward's rows are left-padded
    to its longest sequence ``[R, L]`` (padding masked out, positions counted from each row's first real
    token), so every row's output ends at the last position and the forward keeps the logits of the last
    ``max(n) + 1`` positions only, ``[R, max(n) + 1, V]``; ``max_logits`` bounds R x (max(n) + 1) x V. Equal
    to :func:`sequence_nll` per pair up to the floating-point differences of batch shapes (padding changes no
    row's attention). An empty output gives (0.0, 0)."""
    pairs = [([int(t) for t in p], [int(t) for t in o]) for p, o in pairs]
    results: list[tuple[float, int]] = [(0.0, 0)] * len(pairs)
    todo = sorted((i for i, (_, o) in enumerate(pairs) if o), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    for i in todo:
        if not pairs[i][0]:
            raise InputError("sequence_nll needs at least one prompt token (the first output token is "
                             "conditioned on it)")
    if not todo:
        return results
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size if hasattr(model, "config") else None
    keeps = _accepts_logits_to_keep(model)
    start = 0
    while start < len(todo):
        rows = [todo[start]]
        while start + len(rows) < len(todo) and len(rows) < max_rows:
            nxt = rows + [todo[start + len(rows)]]
            keep = max(len(pairs[i][1]) for i in nxt) + 1
            if vocab is not None and len(nxt) * keep * vocab > max_logits:
                break
            rows = nxt
        start += len(rows)
        seqs = [pairs[i][0] + pairs[i][1] for i in rows]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, width - len(s):] = torch.tensor(s)
            mask[r, width - len(s):] = 1
        ids, mask = ids.to(device), mask.to(device)
        keep = max(len(pairs[i][1]) for i in rows) + 1
        kwargs = {"use_cache": False}
        if any(len(s) < width for s in seqs):  # padded: mask the padding, count positions from each row's first token
            kwargs.update(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        if keeps:
            kwargs["logits_to_keep"] = keep
        logits = model(input_ids=ids, **kwargs).logits  # [R, keep or width, V]
        sums, counts = [], []
        for r, i in enumerate(rows):
            n = len(pairs[i][1])
            # the last n + 1 positions of row r: positions P-1 .. P+n-2 predict the output tokens
            logp = torch.log_softmax(logits[r, logits.shape[1] - n - 1:-1].float(), dim=-1)
            sums.append(-logp.gather(1, ids[r, -n:, None]).sum())
            counts.append(n)
        for i, total, n in zip(rows, torch.stack(sums).tolist(), counts):  # one host sync per forward
            results[i] = (float(total), n)
    return results


def mean_nll(model, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> float | None:
    """Mean NLL per output token (nats), or None for an empty output."""
    total, n = sequence_nll(model, prompt_ids, output_ids)
    return total / n if n else None
