"""FlexAttention's block-sparse kernel against SDPA, called as batched rounds call it:

    python eval/device/flex_check.py          # results also appended to $RES/flex_check.jsonl (default /root/res)

Random queries, keys and values in the default model's attention shape (9 query heads sharing 3 key/value
heads, head dimension 64) over a cache of 1,024 slots; B rows, each with its own committed prefix (ending in
different 128-slot blocks; in one pass row 0's lies in the first block, in the other every prefix passes it)
and a tree of n new rows; every slot holds data, as a refilled row's cache holds its previous prompt's. Keys
and values are views of one buffer ``[2, layers, B, 3, S, 64]``, as the slot cache keeps them (a later layer's
view starts at an offset that grows with B). ``attention.attend`` with ``attention.block_mask`` (per-row lists
and shared lists, and two variants of the per-row lists: LISTS) is run eagerly (the eager kernel applies the
dense mask and reads no lists), compiled with the batch dimension dynamic (as batched rounds compile: one
compilation at B = 2 serves B = 5 and 8) and compiled for a static B = 8, and compared with SDPA under the
dense mask (``prepare_mask(.., "sdpa", ..)``). Each line gives the largest absolute difference per batch row; a
row that sees the wrong slots differs by O(1), rounding by < 1e-4 in float32. On the CPU, inductor's kernel
reads no block lists, so only a GPU run checks them."""
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_eagle.attention import FLEX_BLOCK, attend, block_mask, prepare_mask  # noqa: E402
from fsd_eagle.cache import SlotMask  # noqa: E402

RES = os.environ.get("RES", "/root/res")
SLOTS, HEADS, KV_HEADS, DIM = 8 * FLEX_BLOCK, 9, 3, 64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def log(**kw) -> None:
    line = json.dumps(kw)
    print(line, flush=True)
    os.makedirs(RES, exist_ok=True)
    with open(f"{RES}/flex_check.jsonl", "a") as f:
        f.write(line + "\n")


def inputs(b: int, n: int, seed: int, dtype: torch.dtype, early: bool = True):
    """q [B, 9, n, 64], the cache kv [2, 2, B, 3, S, 64] (keys and values of two layers), prefixes [B] (in
    different blocks) and tree masks [B, n, n]. ``early``: row 0's prefix lies in the first block (shared
    lists then have no full block and start at block 0); else every prefix passes the first block."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, HEADS, n, DIM, generator=gen)
    kv = torch.randn(2, 2, b, KV_HEADS, SLOTS, DIM, generator=gen)
    prefix = torch.randint(1 if early else FLEX_BLOCK, SLOTS - n, (b,), generator=gen)
    if early:
        prefix[0] = 5  # one row early in the first block, the others mostly in later ones
    anc = (torch.rand(b, n, n, generator=gen) < 0.5).tril() | torch.eye(n, dtype=torch.bool)
    move = dict(device=DEVICE)
    return q.to(dtype=dtype, **move), kv.to(dtype=dtype, **move), prefix.to(**move), anc.to(**move)


#: The block lists tried: "shared" and "per_row" as ``block_mask`` builds them; "per_row_no_full": per-row lists
#: with every block up to a row's last one partial (none full), "per_row_heads": per-row lists written out for
#: each of the 9 query heads instead of one list broadcast over them.
LISTS = ("per_row", "shared", "per_row_no_full", "per_row_heads")


def lists_variant(mask, lists: str):
    """The BlockMask of ``lists`` (see LISTS) for ``mask``."""
    from torch.nn.attention.flex_attention import BlockMask

    bm = block_mask(mask, lists == "shared")
    if lists in ("per_row", "shared"):
        return bm
    count, index = bm.kv_num_blocks, bm.kv_indices
    full_count, full_index = bm.full_kv_num_blocks, bm.full_kv_indices
    if lists == "per_row_no_full":
        count = (count + full_count).contiguous()
        index = torch.arange(index.shape[-1], dtype=index.dtype, device=index.device).expand_as(index).contiguous()
        full_count = torch.zeros_like(full_count)
    else:
        count, index, full_count, full_index = (t.expand(t.shape[0], HEADS, *t.shape[2:]).contiguous()
                                                for t in (count, index, full_count, full_index))
    return BlockMask.from_kv_blocks(count, index, full_count, full_index, BLOCK_SIZE=FLEX_BLOCK,
                                    mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths, compute_q_blocks=False)


def flex(q, kv, prefix, anc, lists: str):
    """Layer 1's attention (its keys and values are views at an offset of B rows' layer 0)."""
    return attend(q, kv[0, 1], kv[1, 1], lists_variant(SlotMask(prefix, anc, SLOTS), lists))


def reference(q, kv, prefix, anc):
    return attend(q, kv[0, 1], kv[1, 1], prepare_mask(SlotMask(prefix, anc, SLOTS), "sdpa", q.dtype))


def row_errors(got: torch.Tensor, want: torch.Tensor) -> list[float]:
    return [round(float(x), 6) for x in (got.float() - want.float()).abs().amax(dim=(1, 2, 3))]


def main() -> None:
    dtype = torch.float32
    for n in (1, 64):
        for lists in LISTS:
            torch._dynamo.reset()  # each variant compiles afresh (within dynamo's recompilation limit)
            dynamic = torch.compile(flex, fullgraph=True)
            static = torch.compile(flex, fullgraph=True, dynamic=False)
            for (b, how), early in itertools.product(
                    ((8, "eager"), (2, "compiled_dynamic"), (5, "compiled_dynamic"), (8, "compiled_dynamic"),
                     (8, "compiled_static")), (True, False)):
                args = inputs(b, n, seed=b * 100 + n, dtype=dtype, early=early)
                if how == "compiled_dynamic":
                    for t, dim in zip(args, (0, 2, 0, 0)):
                        torch._dynamo.maybe_mark_dynamic(t, dim)
                fn = {"eager": flex, "compiled_dynamic": dynamic, "compiled_static": static}[how]
                try:
                    errors = row_errors(fn(*args, lists), reference(*args))
                except Exception as e:  # noqa: BLE001 - a check reports every failure and goes on
                    log(n=n, lists=lists, batch=b, how=how, early=early, error=f"{type(e).__name__}: {str(e)[:300]}")
                    continue
                log(n=n, lists=lists, batch=b, how=how, early=early, dtype=str(dtype), device=DEVICE,
                    worst=max(errors), ok=max(errors) < 1e-3, per_row=errors, prefixes=args[2].tolist())
    log(step="done")


if __name__ == "__main__":
    main()
