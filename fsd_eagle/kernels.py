"""Triton kernels for the hot ops of a GPU round; optional: without Triton (or on the CPU) the torch op runs.

``topk``: the draft tree's top-k over a vocabulary. ``torch.topk`` on CUDA is a radix select of about a
dozen kernels and memsets per call. Here one kernel takes each chunk's top k by k max-reductions in
registers and a second merges the chunk winners (the global top k is among them). On an H100, in CUDA
graphs (eval/device/bench_ops.py): a [8, 49152] float32 top-8 took 54.0 us with torch.topk, 10.5 with
these kernels; a top-8 of 64 values 8.5 and 4.2 us. A draft level had cost ~190 us, 56 of them in top-k.
"""

from __future__ import annotations

import importlib.util

import torch

MAX_K = 64  # the kernels unroll k
CHUNK = 2048  # entries a stage-1 program reduces (16 per thread with 4 warps)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k)`` over the last dim of a 2-D float32 tensor ``[R, n]``: values ``[R, k]`` descending and
    their indices. On CUDA with Triton, finite inputs: among equal values the lower index comes first."""
    if (_TRITON_TOPK is None or not x.is_cuda or x.dim() != 2 or x.dtype != torch.float32 or k > MAX_K
            or k > x.shape[1]):
        return x.topk(k)
    return _TRITON_TOPK(x.contiguous(), k)


def _register():
    """The Triton top-k as a torch op (inductor traces it into a compiled round), or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from torch.library import triton_op, wrap_triton

    chunk_topk, merge_topk = jit_kernels()

    @triton_op("fsd_eagle::topk", mutates_args=())
    def triton_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_topk(x, k, wrap_triton(chunk_topk), wrap_triton(merge_topk))

    return triton_topk


def launch_topk(x: torch.Tensor, k: int, chunk_topk, merge_topk) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the two kernels (as given: jitted, or wrapped for tracing) on ``x [R, n]``."""
    import triton

    rows, n = x.shape
    size = min(CHUNK, max(16, triton.next_power_of_2(n)))
    chunks = triton.cdiv(n, size)
    vals = torch.empty((rows, chunks * k), device=x.device, dtype=torch.float32)
    idx = torch.empty((rows, chunks * k), device=x.device, dtype=torch.int64)
    chunk_topk[(rows, chunks)](x, vals, idx, n, x.stride(0), CHUNK=size, K=k)
    if chunks > 1:
        out = torch.empty((rows, k), device=x.device, dtype=torch.int64)
        m = chunks * k
        merge_topk[(rows,)](vals, idx, out, m, M=triton.next_power_of_2(m), K=k)
        idx = out
    return x.gather(1, idx), idx


def jit_kernels():
    """The two Triton kernels (jitted; launch them with ``launch_topk``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_topk(x_ptr, vals_ptr, idx_ptr, n, stride, CHUNK: tl.constexpr, K: tl.constexpr):
        """Program (row, chunk): the top K of x[row, chunk * CHUNK:][:CHUNK] to vals/idx[row, chunk * K:]."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = tl.arange(0, CHUNK)
        cols = chunk * CHUNK + offs
        x = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=float("-inf"))
        # Real entries (even -inf ones: clamped to float32's min) stay above taken and padding ones (-inf).
        x = tl.where(cols < n, tl.maximum(x, -3.4028234663852886e38), x)
        out = (row * tl.num_programs(1) + chunk) * K
        for i in tl.static_range(K):
            best, j = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(vals_ptr + out + i, best)
            tl.store(idx_ptr + out + i, chunk * CHUNK + j)
            x = tl.where(offs == j, float("-inf"), x)

    @triton.jit
    def merge_topk(vals_ptr, idx_ptr, out_ptr, m, M: tl.constexpr, K: tl.constexpr):
        """Program row: the top K of the m chunk winners vals/idx[row] (index order kept on ties)."""
        row = tl.program_id(0)
        offs = tl.arange(0, M)
        v = tl.load(vals_ptr + row * m + offs, mask=offs < m, other=float("-inf"))
        ids = tl.load(idx_ptr + row * m + offs, mask=offs < m, other=0)
        for i in tl.static_range(K):
            best, j = tl.max(v, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(out_ptr + row * K + i, tl.sum(tl.where(offs == j, ids, 0), axis=0))
            v = tl.where(offs == j, float("-inf"), v)

    return chunk_topk, merge_topk


# Resolved once at import: a lookup (or an lru_cache) inside a compiled round would break its graph.
_TRITON_TOPK = _register()
