"""Tree attention for the target and the head, over a static slot cache with an explicit mask.

A boolean mask ``[n, S]`` (query rows x cache slots, from ``cache.attention_mask``) is prepared once per
forward for one of two backends, then every layer attends with it:

- ``"sdpa"``: SDPA with an additive mask ``[1, 1, n, S]`` (transformers' own SDPA function for the target).
  It reads all S slots, used or not: on the H200 the masked kernel over a 2048-slot cache was a third of
  an EAGLE-2 round (1.2 of 3.5 ms).
- ``"flex"``: FlexAttention with a block-sparse mask: KV blocks that no row sees (the unused end of the
  cache) are skipped, and grouped-query heads share their keys in the kernel (no ``repeat_kv`` copies).
  Fast only when compiled (the compiled CUDA round: 3.9 -> 3.0 ms per EAGLE-2 round); its eager form is a
  slow reference, so prefills always use "sdpa".

The target reaches these through a registered transformers attention function (``ATTENTION_NAME``); masks
that are not BlockMasks (ours for "sdpa", transformers' own in ``generate``) go to the stock SDPA function.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .errors import ConfigError

BACKENDS = ("sdpa", "flex")
ATTENTION_NAME = "fsd_eagle"
FLEX_BLOCK = 128


def whole_blocks(slots: int) -> int:
    """``slots`` rounded up to whole FlexAttention blocks: cache sizes, so that either backend can use a cache."""
    return -(-slots // FLEX_BLOCK) * FLEX_BLOCK


def prepare_mask(mask: torch.Tensor, backend: str, dtype: torch.dtype):
    """The boolean mask ``[n, S]`` in the form ``attend`` takes for ``backend`` (S a multiple of FLEX_BLOCK
    for "flex")."""
    if backend == "flex":
        return _block_mask(mask)
    neg = torch.finfo(dtype).min
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, neg)[None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None) -> torch.Tensor:
    """q ``[1, H_q, n, d]``, k/v ``[1, H_kv, S, d]`` (the whole cache), mask from ``prepare_mask``.
    Returns ``[1, H_q, n, d]``."""
    groups = q.shape[1] // k.shape[1]
    if not isinstance(mask, torch.Tensor):  # a BlockMask
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=groups > 1)
    if groups > 1:  # SDPA's masked kernels have no grouped-query support on CUDA
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _block_mask(mask: torch.Tensor):
    """A FlexAttention BlockMask from a dense boolean mask ``[n, S]``: blocks where every row sees every slot
    are "full" (no mask lookup), blocks where some do are "partial", the rest are skipped."""
    from torch.nn.attention.flex_attention import BlockMask

    n, s = mask.shape
    if s % FLEX_BLOCK:
        raise ConfigError(f"a FlexAttention cache needs a multiple of {FLEX_BLOCK} slots, got {s}")
    pad = whole_blocks(n) - n
    nq, nk = (n + pad) // FLEX_BLOCK, s // FLEX_BLOCK

    def blocks(fill: bool) -> torch.Tensor:  # [nq, B, nk, B]; padding rows are never computed
        rows = torch.cat([mask, mask.new_full((pad, s), fill)]) if pad else mask
        return rows.view(nq, FLEX_BLOCK, nk, FLEX_BLOCK)

    rows = blocks(False)
    full = blocks(True).all(3).all(1)
    partial = rows.any(3).any(1) & ~full

    def kv_list(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        count = sel.sum(-1, dtype=torch.int32)
        order = torch.argsort(sel.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    dense = rows.view(nq * FLEX_BLOCK, s)

    def mask_mod(b, h, q_idx, kv_idx):
        return dense[q_idx, kv_idx]

    return BlockMask.from_kv_blocks(*kv_list(partial), *kv_list(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n, s))


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (registered as ATTENTION_NAME): BlockMasks go to ``attend``, anything
    else to the stock SDPA function. Returns ``([B, n, H_q, d], None)``."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attend(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None


@functools.cache
def register() -> None:
    """Register ``tree_attention`` (and SDPA's mask builder for it) with transformers, once."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, tree_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def check_backend(backend: str, config) -> None:
    """Refuse backends a model cannot use (one readable line)."""
    if backend not in BACKENDS:
        raise ConfigError(f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "flex" and getattr(config, "attn_logit_softcapping", None):
        raise ConfigError("the 'flex' attention backend has no logit soft-capping: use 'sdpa' for this model")


def no_cudnn():
    """SDPA without the cuDNN kernel, for eager forwards of new shapes (prefills): cuDNN builds a plan per
    new prompt length, measured at ~40 ms of a 66 ms prefill on the H200."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
