"""Tree attention for the target and the head, over a static slot cache with an explicit mask.

A ``cache.SlotMask`` (which cache slots each query row sees) is prepared once per forward for one of two
backends, then every layer attends with it:

- ``"sdpa"``: SDPA with an additive mask ``[B, 1, n, S]``. With grouped-query attention (H_q = g x H_kv
  heads) and few query rows (rounds, short prefills: g x n <= PACK_ROWS), the mask is packed: ``[B, 1,
  g x n, S]``, and each key/value head attends for its g query heads at once (queries ``[B, H_kv, g x n,
  d]``), so the cache is read as it is instead of being copied g times in every layer (``repeat_kv``, which
  SDPA's masked CUDA kernels need otherwise; the copies grow with the batch and the cache). Otherwise keys
  and values are repeated per query head. It reads all S slots, used or not: on the H200 the masked kernel
  over a 2048-slot cache was a third of an EAGLE-2 round (1.2 of 3.5 ms). A mask of fewer columns than the
  cache has slots, ``[.., n, S']`` (a ``SlotMask`` whose ``max_len`` is S' < S), covers the first S' slots
  only, and only those are read: a prefill into an empty cache attends over its own L slots (on the H200 the
  kernel over the whole cache was half of a 128-token prefill: 3.5 of 6.9 ms).
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

from .cache import SlotMask
from .errors import ConfigError

BACKENDS = ("sdpa", "flex")
ATTENTION_NAME = "fsd_eagle"
FLEX_BLOCK = 128
#: Packed SDPA masks (see the module docstring) have at most this many rows: every round of a tree of up to
#: 512 / g nodes, and prefills of as many tokens; a longer prefill's mask would be g times larger than the
#: key/value copies it saves.
PACK_ROWS = 512


def whole_blocks(slots: int) -> int:
    """``slots`` rounded up to whole FlexAttention blocks: cache sizes, so that either backend can use a cache."""
    return -(-slots // FLEX_BLOCK) * FLEX_BLOCK


def prepare_mask(mask: SlotMask, backend: str, dtype: torch.dtype, heads: int = 1, kv_heads: int | None = None):
    """``mask`` in the form ``attend`` takes for ``backend`` (its cache size a multiple of FLEX_BLOCK for
    "flex"); ``heads`` / ``kv_heads``: the query and key/value heads of the layers that attend with it
    (``block_mask``'s lists per head; SDPA's packed mask ``[B, 1, g x n, S]``, row j x n + i being query row
    i, where g = heads / kv_heads > 1 and g x n <= PACK_ROWS; else ``[B, 1, n, S]``)."""
    if backend == "flex":
        return block_mask(mask, heads=heads)
    dense = mask.dense()  # [B, n, S]
    groups = heads // kv_heads if kv_heads else 1
    if groups > 1 and groups * dense.shape[1] <= PACK_ROWS:
        dense = dense.repeat(1, groups, 1)  # [B, g * n, S]
    neg = torch.finfo(dtype).min
    return torch.zeros(dense.shape, dtype=dtype, device=dense.device).masked_fill_(~dense, neg).unsqueeze(1)


def packed(mask, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``mask`` is a packed SDPA mask for queries ``q`` ``[B, H_q, n, d]`` and keys ``k`` ``[B, H_kv,
    S, d]`` (``prepare_mask``): a 4-d tensor of g x n rows, g = H_q / H_kv > 1."""
    groups = q.shape[1] // k.shape[1]
    return (isinstance(mask, torch.Tensor) and mask.dim() == 4 and groups > 1
            and mask.shape[-2] == groups * q.shape[2])


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float | None = None) -> torch.Tensor:
    """q ``[B, H_q, n, d]``, k/v ``[B, H_kv, S, d]`` (the whole cache), mask from ``prepare_mask`` (packed or
    not), or a boolean ``[n, S]`` (True = attend; the head's unrolled training steps); a tensor mask of S' < S
    columns reads the first S' slots only. Returns ``[B, H_q, n, d]``."""
    groups = q.shape[1] // k.shape[1]
    if not isinstance(mask, torch.Tensor):  # a BlockMask
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=groups > 1,
                              kernel_options=_flex_options(q))
    k, v = mask_keys(k, v, mask)
    if packed(mask, q, k):  # each key/value head attends for its g query heads: [B, H_kv, g * n, d]
        b, h, n, d = q.shape
        out = F.scaled_dot_product_attention(q.reshape(b, h // groups, groups * n, d), k, v, attn_mask=mask,
                                             scale=scale)
        return out.reshape(b, h, n, d)  # CUDA kernels may return [B, H_kv, g*n, d] with other strides
    if groups > 1:  # SDPA's masked kernels have no grouped-query support on CUDA
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def mask_keys(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """k/v ``[B, H_kv, S, d]`` cut to the slots a dense ``mask`` ``[.., S']`` covers (S' <= S: views of the
    first S' slots)."""
    if mask is None or mask.shape[-1] >= k.shape[2]:
        return k, v
    return k[:, :, :mask.shape[-1]], v[:, :, :mask.shape[-1]]


def _flex_options(q: torch.Tensor) -> dict | None:
    """FlexAttention's query tile on CUDA for fewer than FLEX_BLOCK query rows: 16 rows, not the default
    128. A round's queries are few (AR 1, a draft level 8, a tree 48) and the grid has one program per
    (query tile, head), so a 128-row tile computes mostly padding on few programs. On an H100 (9/3 heads x
    64, ~500 cached tokens; eval/device/bench_ops.py) 1 / 8 / 48 rows took 16.2 / 16.4 / 20.6 us with the
    default tile, 8.6 / 8.6 / 10.5 with 64 rows and 7.0 / 7.0 / 8.3 with 16."""
    if not q.is_cuda or q.shape[2] >= FLEX_BLOCK:
        return None
    return {"BLOCK_M": 16}


def block_mask(mask: SlotMask, shared: bool = False, heads: int = 1):
    """A FlexAttention BlockMask (forward only: no q-block lists, which only the backward reads). Blocks
    wholly inside the committed prefix are "full" (no mask lookup), the blocks from the prefix's last one to
    the end of the new rows "partial" (the dense mask decides), the rest skipped; with a sliding window
    every block up to the new rows is partial. The lists come from ``mask.prefix`` by arithmetic: a round
    builds a mask per draft level, and reductions and sorts over dense block flags cost ~8 kernels each.

    Each batch row gets its own lists, so a row scans only its own prefix's blocks. With more than one row
    they are written out for each of the ``heads`` query heads (lists ``[B, heads, ..]``): the compiled GPU
    kernel misreads per-row lists broadcast over the heads (``[B, 1, ..]``): on an H200 (float32,
    2026-11-28; eval/device/flex_check.py, docs/history.md) rows differed from SDPA by O(1), while
    the same lists written per head agreed to 2e-6 in every case. The CPU cannot show it (its kernel reads
    no lists). One row's lists stay ``[1, 1, ..]``.

    ``shared``: one pair of lists for all rows (the BlockMask's batch and head sizes are 1), the union of
    the rows' own: full are the blocks that every row's prefix covers whole, partial the blocks from there
    to the last one any row reaches, so a row may scan blocks that its mask then hides (right on the GPU
    too, but slower where prefixes differ)."""
    from torch.nn.attention.flex_attention import BlockMask

    (b, n, m), s = mask.anc.shape, mask.max_len
    if s % FLEX_BLOCK:
        raise ConfigError(f"a FlexAttention cache needs a multiple of {FLEX_BLOCK} slots, got {s}")
    nq, nk = whole_blocks(n) // FLEX_BLOCK, s // FLEX_BLOCK
    cols = torch.arange(nk, dtype=torch.int32, device=mask.anc.device)
    last = (mask.prefix + m - 1) // FLEX_BLOCK  # [B]
    windowed = mask.window is not None
    full = torch.zeros_like(mask.prefix) if windowed else mask.prefix // FLEX_BLOCK  # [B]
    rows, per_head = b, heads if b > 1 else 1
    if shared:  # one list for every row: the union of the rows' blocks
        last, full, rows, per_head = last.amax(0, keepdim=True), full.amin(0, keepdim=True), 1, 1

    def lists(count: torch.Tensor, first: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """count [R, P, nq] and indices [R, P, nq, nk] (R: the lists' rows, P: their heads): blocks first,
        first + 1, ... (in range) per row; blocks 0, 1, ... where ``first`` is None. (Not cols plus a zero
        tensor: inductor drops such an addition after comparing its shape [B, nk] with cols' [nk], and the
        comparison fixes a symbolic batch size B to nk where the two are equal, so that each batch size
        compiles again.)"""
        if first is None:
            index = cols.expand(rows, nk)
        else:
            index = (cols + first.unsqueeze(1)).clamp(max=nk - 1).to(torch.int32)
        return (count.to(torch.int32).view(rows, 1, 1).expand(rows, per_head, nq).contiguous(),
                index.view(rows, 1, 1, nk).expand(rows, per_head, nq, nk).contiguous())

    dense = mask.dense(nq * FLEX_BLOCK)  # whole query blocks: the kernel evaluates whole tiles

    def mask_mod(batch, h, q_idx, kv_idx):
        return dense[batch, q_idx, kv_idx]

    partial = lists(last + 1, None) if windowed else lists(last - full + 1, full)
    return BlockMask.from_kv_blocks(*partial, *lists(full, None),
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(n, s),
                                    compute_q_blocks=False)


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (registered as ATTENTION_NAME): BlockMasks and packed SDPA masks go to
    ``attend``, anything else to the stock SDPA function (over the slots a narrower mask covers:
    ``mask_keys``). Returns ``([B, n, H_q, d], None)``."""
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask) and not packed(attention_mask, query, key):
        key, value = mask_keys(key, value, attention_mask)
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


def flex_supported(config) -> bool:
    """Whether a model's attention fits FlexAttention here (no logit soft-capping)."""
    return not getattr(config, "attn_logit_softcapping", None)


def check_backend(backend: str, config) -> None:
    """Refuse backends a model cannot use (one readable line)."""
    if backend not in BACKENDS:
        raise ConfigError(f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "flex" and not flex_supported(config):
        raise ConfigError("the 'flex' attention backend has no logit soft-capping: use 'sdpa' for this model")


def no_cudnn():
    """SDPA without the cuDNN kernel, for eager forwards of new shapes (prefills): cuDNN builds a plan per
    new prompt length, measured at ~40 ms of a 66 ms prefill on the H200."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
