"""Per-row divergences between the target distribution p and the draft distribution q.

Symbols: p = target (``target_logits``), q = draft (``draft_logits``), both ``[m, V]`` logits.

``divergence(name, target_logits, draft_logits, support_top_k=0)`` returns ``[m]`` float32 for
``name`` in ``DIVERGENCES``:

- ``kl``         KL(q || p) = sum q (log q - log p)
- ``reverse_kl`` KL(p || q)
- ``js``         0.5 KL(p || m) + 0.5 KL(q || m), m = (p + q) / 2; bounded by ln 2
- ``js_legacy``  0.5 KL(m || p) + 0.5 KL(m || q): the argument-swapped form of the FSD authors'
                 released code. Unbounded; kept only to reproduce their numbers.
- ``tv``         0.5 sum |p - q|, in [0, 1]

Everything is computed in float32 from ``log_softmax``. Before any KL arithmetic every
log-probability is clamped from below at ``LOG_FLOOR`` (about log 1e-30). So where the true
value is +inf (KL(a || b) with a > 0 where b = 0, e.g. after top-k / top-p filtering put -inf in
the logits) the result is a large finite number (at most about -LOG_FLOOR = 69) instead, and
zero-weight terms contribute exactly 0 (0 * finite). Results are never NaN or inf and are >= 0.

``support_top_k > 0`` keeps, per row, the k tokens with the largest target logits plus one
extra bin holding the rest of each distribution's mass, and computes the divergence on those
k + 1 bins.

Batched, fixed shapes, no host sync and no branching on tensor values: safe inside a decoding
loop and under CUDA graph capture. Argument validation is plain Python on the arguments.
"""

from __future__ import annotations

import math

import torch

from fsd_eagle.errors import ConfigError, InputError

DIVERGENCES = ("kl", "reverse_kl", "js", "js_legacy", "tv")
LOG_FLOOR = -69.0  # ~ log(1e-30): lower clamp of every log-probability in the KL arithmetic
_LN2 = math.log(2.0)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per row from log-probs. Clamping makes the log difference finite, so a
    zero weight (log_a = -inf, exp -> 0) gives an exact 0 term rather than 0 * -inf = NaN."""
    diff = log_a.clamp_min(LOG_FLOOR) - log_b.clamp_min(LOG_FLOOR)
    return (log_a.exp() * diff).sum(-1)


def _truncate(
    log_p: torch.Tensor, log_q: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict both log-distributions to the top-k tokens of p plus one 'rest' bin."""
    k = min(k, log_p.shape[-1])  # static shape, not a tensor value
    idx = log_p.topk(k, dim=-1).indices
    outs = []
    for lx in (log_p, log_q):
        kept = lx.gather(-1, idx)
        # Rest mass as logsumexp over the non-kept tokens: accurate even when it is tiny
        # (no 1 - sum cancellation); -inf when nothing is left.
        rest = lx.scatter(-1, idx, float("-inf")).logsumexp(-1, keepdim=True)
        outs.append(torch.cat([kept, rest], dim=-1))
    return outs[0], outs[1]


def divergence(
    name: str,
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    support_top_k: int = 0,
) -> torch.Tensor:
    """Divergence ``name`` between p = softmax(target_logits) and q = softmax(draft_logits),
    row by row: ``[m, V]`` logits (any float dtype, -inf allowed, >= 1 finite entry per row)
    -> ``[m]`` float32, finite and >= 0."""
    if name not in DIVERGENCES:
        raise ConfigError(f"unknown divergence {name!r}; expected one of {', '.join(DIVERGENCES)}")
    if isinstance(support_top_k, bool) or not isinstance(support_top_k, int) or support_top_k < 0:
        raise ConfigError(f"support_top_k must be an integer >= 0, got {support_top_k!r}")
    if target_logits.shape != draft_logits.shape:
        raise InputError(
            f"target and draft logits differ in shape: {tuple(target_logits.shape)} vs "
            f"{tuple(draft_logits.shape)}"
        )

    log_p = torch.log_softmax(target_logits.float(), dim=-1)
    log_q = torch.log_softmax(draft_logits.float(), dim=-1)
    if support_top_k > 0:
        log_p, log_q = _truncate(log_p, log_q, support_top_k)

    if name == "kl":
        out = _kl(log_q, log_p)
    elif name == "reverse_kl":
        out = _kl(log_p, log_q)
    elif name == "tv":
        return (0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)).clamp(0.0, 1.0)
    else:
        log_m = torch.logaddexp(log_p, log_q) - _LN2
        if name == "js":
            return (0.5 * (_kl(log_p, log_m) + _kl(log_q, log_m))).clamp(0.0, _LN2)
        out = 0.5 * (_kl(log_m, log_p) + _kl(log_m, log_q))  # js_legacy
    return out.clamp_min(0.0)  # tiny negative rounding -> 0
