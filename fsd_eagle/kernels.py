"""Triton kernels for the hot ops of a GPU round; optional: without Triton (or on the CPU) the torch op runs.

``rejection_states``: the verifier's recursive-rejection states over a pool of children (see its docstring).

``pool_draw``: one draft level's sampled children from each expanded node's pool, with the random numbers
drawn in the kernel (see its docstring).

``topk``: the draft tree's top-k over a vocabulary. ``torch.topk`` on CUDA is a radix select of about a
dozen kernels and memsets per call. Here one kernel takes each chunk's top k with one partial bitonic sort of
value-index keys (``tl.topk``), and a second merges the chunk winners the same way (the global top k is among
them). On an H200, in CUDA graphs (``python eval/device/bench_ops.py --skip topk,flex,batch,decode``,
2026-12-02): over 8 rows of a 16,384-token draft vocabulary, a top-8 took 6.3 us (torch.topk 66.1), a top-16
7.3 and a top-32 9.1 us, where the kernels they replace (k max-reductions one after another per chunk, then
per merge) took 9.3, 16.0 and 30.1 us: the top 32 of a pool of sampled children is taken once per draft
level.
"""

from __future__ import annotations

import importlib.util

import torch

MAX_K = 64  # the widest top-k the kernels take (a bitonic sort of the next power of two keys per program)
MAX_CHUNKS = 64  # stage-1 programs per row at most: a longer row gets longer chunks (a smaller merge)
MAX_POOL = 1024  # the widest p and r that rejection_states holds in registers (one row block)
MAX_SLOTS = 64  # rejection_states unrolls the child slots
MAX_DRAW_POOL = 128  # pool_draw ranks a pool by comparing every pair of its entries in registers


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k)`` over the last dim of a 2-D float32 tensor ``[R, n]``: values ``[R, k]`` descending and
    their indices. On CUDA with Triton, finite inputs: among equal values the lower index comes first."""
    if (_TRITON_TOPK is None or not x.is_cuda or x.dim() != 2 or x.dtype != torch.float32 or k > MAX_K
            or k > x.shape[1]):
        return x.topk(k)
    return _TRITON_TOPK(x.contiguous(), k)


def fits_rejection_states(p: torch.Tensor, slots: int) -> bool:
    """Whether ``rejection_states`` runs the Triton kernel for distributions ``p [..., S]`` and ``slots``
    children: on CUDA with Triton, S at most MAX_POOL (children from a pool; a whole vocabulary takes the torch
    sums), at most MAX_SLOTS children."""
    return (_TRITON_REJECTION is not None and p.is_cuda and p.dim() >= 2 and p.shape[-1] <= MAX_POOL
            and 0 < slots <= MAX_SLOTS)


def rejection_states(p, r, px, rx, exists, outside) -> tuple[torch.Tensor, ...]:
    """``verify._rejection_states`` in one Triton kernel (see there for the arguments and the coef, mass,
    r_mass ``[..., slots + 1]`` and kept ``[..., slots]`` it returns), for ``fits_rejection_states`` inputs.

    Why a kernel: the states are a chain of sums over the pool, each depending on the one before (a child's
    turn comes only after every earlier child was rejected). Inductor fused two links of that chain into one
    reduction kernel that Triton 3.6 failed to compile for sm_90 (``PassManager::run failed`` in
    TritonGPURemoveLayoutConversions, persistent or looped), so the whole compiled round fell back to
    uncompiled graph rounds. Here each program holds a block of nodes' p and r (S <= MAX_POOL columns) in
    registers and runs the chain over the child slots there: one launch, that inductor does not fuse."""
    lead, size, slots = p.shape[:-1], p.shape[-1], px.shape[-1]
    rows = p[..., 0].numel()
    outside = torch.zeros(lead, device=p.device) + outside  # a float (0.0, no mass left out) or a tensor
    coef, mass, r_mass, kept = _TRITON_REJECTION(
        p.reshape(rows, size).float().contiguous(), r.reshape(rows, size).float().contiguous(),
        px.reshape(rows, slots).float().contiguous(), rx.reshape(rows, slots).float().contiguous(),
        exists.reshape(rows, slots).contiguous(), outside.reshape(rows).float().contiguous())
    return (coef.view(*lead, slots + 1), mass.view(*lead, slots + 1), r_mass.view(*lead, slots + 1),
            kept.view(*lead, slots))


def fits_pool_draw(vals: torch.Tensor, k: int) -> bool:
    """Whether ``pool_draw`` runs the Triton kernel for pools ``vals [R, S]`` and ``k`` children: on CUDA
    with Triton, float32, S at most MAX_DRAW_POOL."""
    return (_TRITON_DRAW is not None and vals.is_cuda and vals.dim() == 2 and vals.dtype == torch.float32
            and 0 < k <= vals.shape[1] <= MAX_DRAW_POOL)


def pool_draw(vals: torch.Tensor, temperature: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, level: int,
              rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k children of each of R = B x ``rows`` draft rows, drawn without replacement from the row's pool at its
    batch row's temperature, for ``fits_pool_draw`` inputs: what ``tree._pool_children`` does with torch ops,
    in one launch instead of four (the uniforms, the Gumbel keys, their top k, and the sort of the drawn
    values), since a draft level's other kernels each take a few microseconds too.

    vals ``[R, S]``: each row's pool logits in descending order (row b * rows + i: batch row b); temperature
    ``[B]``; w1, w2 ``[B, D]``: the words of D draws (``RandomStream.words``), of which column ``level``
    keys this one: element j of row (b, i) gets the uniform of mix32(mix32((i * S + j) ^ w1) ^ w2), as
    ``RandomStream.uniform((rows, S), draw)`` would give it. Returns the drawn pool positions ``[R, k]`` in
    draw order (Gumbel-top-k: the k largest vals / T - log(-log u), ties to the lower position) and the
    drawn values in descending order ``[R, k]`` (the pool is sorted, so: in position order)."""
    return _TRITON_DRAW(vals.contiguous(), temperature.float().contiguous(), w1.contiguous(), w2.contiguous(),
                        level, rows, k)


def launch_pool_draw(vals, temperature, w1, w2, level: int, rows: int, k: int, kernel
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel (as given: jitted, or wrapped for tracing); see ``pool_draw``."""
    import triton

    total, size = vals.shape
    drawn = torch.empty((total, k), device=vals.device, dtype=torch.int64)
    drawn_vals = torch.empty((total, k), device=vals.device, dtype=torch.float32)
    kernel[(total,)](vals, temperature, w1, w2, drawn, drawn_vals, size, rows, level, w1.shape[1], K=k,
                     S_P2=max(16, triton.next_power_of_2(size)))
    return drawn, drawn_vals


def launch_rejection_states(p, r, px, rx, exists, outside, kernel) -> tuple[torch.Tensor, ...]:
    """Run the kernel (as given: jitted, or wrapped for tracing) on ``p, r [R, S]``, ``px, rx, exists
    [R, slots]`` and ``outside [R]``; returns coef, mass, r_mass ``[R, slots + 1]`` and kept ``[R, slots]``."""
    import triton

    rows, size = p.shape
    slots = px.shape[1]
    states = [torch.empty((rows, slots + 1), device=p.device, dtype=torch.float32) for _ in range(3)]
    kept = torch.empty((rows, slots), device=p.device, dtype=torch.float32)
    block = 8  # rows per program
    kernel[(triton.cdiv(rows, block),)](p, r, px, rx, exists, outside, *states, kept, rows, size, SLOTS=slots,
                                       SLOTS_P2=triton.next_power_of_2(slots),
                                       BLOCK_S=max(16, triton.next_power_of_2(size)), ROWS=block)
    return (*states, kept)


def _register():
    """The Triton kernels as torch ops (inductor traces them into a compiled round), or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None, None, None
    from torch.library import triton_op, wrap_triton

    chunk_topk, merge_topk = jit_kernels()
    states = jit_rejection_states()
    draw = jit_pool_draw()
    # A compiled round kept on disk (fsd_eagle.precompiled) names each kernel it launches by its module and
    # name; bound here as attributes of this module, they are found when a new process loads the round.
    globals().update({kernel.fn.__name__: kernel for kernel in (chunk_topk, merge_topk, states, draw)})

    @triton_op("fsd_eagle::topk", mutates_args=())
    def triton_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_topk(x, k, wrap_triton(chunk_topk), wrap_triton(merge_topk))

    @triton_op("fsd_eagle::rejection_states", mutates_args=())
    def triton_rejection_states(p: torch.Tensor, r: torch.Tensor, px: torch.Tensor, rx: torch.Tensor,
                                exists: torch.Tensor, outside: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch_rejection_states(p, r, px, rx, exists, outside, wrap_triton(states))

    @triton_op("fsd_eagle::pool_draw", mutates_args=())
    def triton_pool_draw(vals: torch.Tensor, temperature: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                         level: int, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return launch_pool_draw(vals, temperature, w1, w2, level, rows, k, wrap_triton(draw))

    return triton_topk, triton_rejection_states, triton_pool_draw


def topk_shape(n: int, k: int) -> tuple[int, int]:
    """The stage-1 chunk (entries per program, a power of two) and warps per program of a top-k over rows of
    ``n`` entries: the fastest of chunks of 512 to 4,096 entries and 2 to 8 warps for k = 8, 16 and 32 over
    16,384 entries on an H200 (eval/device/bench_ops.py's ``pool_topk``), with at most MAX_CHUNKS chunks."""
    import triton

    chunk = max(512 if k <= 8 else 1024, triton.next_power_of_2(-(-n // MAX_CHUNKS)))
    return min(chunk, max(16, triton.next_power_of_2(n))), 4 if k <= 8 else 8


def launch_topk(x: torch.Tensor, k: int, chunk_topk, merge_topk, chunk: int | None = None,
                warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the two kernels (as given: jitted, or wrapped for tracing) on ``x [R, n]``: stage 1 over chunks
    of ``chunk`` entries (a power of two, at least the next power of two above k), both stages with ``warps``
    warps per program (None: ``topk_shape``'s, what ``topk`` runs; eval/device/bench_ops.py times others)."""
    import triton

    rows, n = x.shape
    shape = topk_shape(n, k)
    size, warps = min(chunk or shape[0], max(16, triton.next_power_of_2(n))), warps or shape[1]
    k_p2 = max(2, triton.next_power_of_2(k))  # a top 1 would reduce the sort's keys to a scalar
    chunks = triton.cdiv(n, size)
    vals = torch.empty((rows, chunks * k), device=x.device, dtype=torch.float32)
    idx = torch.empty((rows, chunks * k), device=x.device, dtype=torch.int64)
    chunk_topk[(rows, chunks)](x, vals, idx, n, x.stride(0), CHUNK=size, K=k, K_P2=k_p2, num_warps=warps)
    if chunks > 1:
        out = torch.empty((rows, k), device=x.device, dtype=torch.int64)
        m = chunks * k
        merge_topk[(rows,)](vals, idx, out, m, M=triton.next_power_of_2(m), K=k, K_P2=k_p2, num_warps=warps)
        idx = out
    return x.gather(1, idx), idx


def jit_kernels():
    """The two Triton kernels (jitted; launch them with ``launch_topk``).

    Each ranks entries by one int64 key: an order-preserving int32 image of the float32 value (the magnitude
    bits of negatives flipped) above the complement of the column, so that among equal values the lower
    column ranks first, and takes the top K_P2 (K rounded up to a power of two, as ``tl.topk`` needs) of its
    keys in descending order, of which it keeps the first K."""
    import triton
    import triton.language as tl

    @triton.jit
    def chunk_topk(x_ptr, vals_ptr, idx_ptr, n, stride, CHUNK: tl.constexpr, K: tl.constexpr,
                   K_P2: tl.constexpr):
        """Program (row, chunk): the top K of x[row, chunk * CHUNK:][:CHUNK] to vals/idx[row, chunk * K:],
        in descending order."""
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride + cols, mask=cols < n, other=float("-inf"))
        # Real entries (even -inf ones: clamped to float32's min) rank above the padding (-inf).
        x = tl.where(cols < n, tl.maximum(x, -3.4028234663852886e38), x)
        bits = x.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        keys = (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - cols.to(tl.int64))
        top = tl.topk(keys, K_P2)  # [K_P2], descending
        rank = tl.arange(0, K_P2)
        out = (row * tl.num_programs(1) + chunk) * K + rank
        value = (top >> 32).to(tl.int32)
        tl.store(vals_ptr + out, (value ^ ((value >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True),
                 mask=rank < K)
        tl.store(idx_ptr + out, 0xFFFFFFFF - (top & 0xFFFFFFFF), mask=rank < K)

    @triton.jit
    def merge_topk(vals_ptr, idx_ptr, out_ptr, m, M: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr):
        """Program row: the columns of the top K of the m chunk winners vals/idx[row], in descending order."""
        row = tl.program_id(0)
        offs = tl.arange(0, M)
        v = tl.load(vals_ptr + row * m + offs, mask=offs < m, other=float("-inf"))
        cols = tl.load(idx_ptr + row * m + offs, mask=offs < m, other=0xFFFFFFFF)
        bits = v.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        keys = (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - cols)
        top = tl.topk(keys, K_P2)
        rank = tl.arange(0, K_P2)
        tl.store(out_ptr + row * K + rank, 0xFFFFFFFF - (top & 0xFFFFFFFF), mask=rank < K)

    return chunk_topk, merge_topk


def jit_rejection_states():
    """The jitted rejection-states kernel (launch it with ``launch_rejection_states``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rejection_states_kernel(p_ptr, r_ptr, px_ptr, rx_ptr, ex_ptr, out_ptr, coef_ptr, mass_ptr, rmass_ptr,
                                kept_ptr, rows, size, SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr,
                                BLOCK_S: tl.constexpr, ROWS: tl.constexpr):
        """Program i: rows [i * ROWS, (i + 1) * ROWS); each row's states before every child slot and after
        the last, in the order of verify._rejection_states (the same float32 operations)."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
        live = row < rows
        cols = tl.arange(0, BLOCK_S)[None, :]
        p = tl.load(p_ptr + row * size + cols, mask=live & (cols < size), other=0.0)
        r = tl.load(r_ptr + row * size + cols, mask=live & (cols < size), other=0.0)
        slot = tl.arange(0, SLOTS_P2)[None, :]
        in_slots = live & (slot < SLOTS)
        px = tl.load(px_ptr + row * SLOTS + slot, mask=in_slots, other=0.0)
        rx = tl.load(rx_ptr + row * SLOTS + slot, mask=in_slots, other=0.0)
        exists = tl.load(ex_ptr + row * SLOTS + slot, mask=in_slots, other=0) != 0
        outside = tl.load(out_ptr + row, mask=live, other=0.0)
        coef = tl.zeros([ROWS, 1], dtype=tl.float32)
        mass = coef + 1.0
        r_mass = coef + 1.0
        kept = tl.zeros([ROWS, SLOTS_P2], dtype=tl.float32)
        width = SLOTS + 1
        tl.store(coef_ptr + row * width, coef, mask=live)
        tl.store(mass_ptr + row * width, mass, mask=live)
        tl.store(rmass_ptr + row * width, r_mass, mask=live)
        for j in tl.static_range(SLOTS):
            here = slot == j
            there = tl.sum(tl.where(here & exists, 1, 0), 1)[:, None] > 0
            rx_j = tl.sum(tl.where(here, rx, 0.0), 1)[:, None]
            coef = tl.where(there, coef + mass / r_mass, coef)
            r_mass = tl.where(there, tl.maximum(r_mass - rx_j, 1e-30), r_mass)
            at = tl.maximum(px - coef * rx, 0.0)  # every slot's p at the new coefficient
            earlier = tl.sum(tl.where(slot < j, at - kept, 0.0), 1)[:, None]
            kept = tl.where(here, at, kept)
            total = tl.sum(tl.maximum(p - coef * r, 0.0), 1)[:, None] + outside - earlier
            mass = tl.where(there, tl.maximum(total, 1e-30), mass)
            tl.store(coef_ptr + row * width + j + 1, coef, mask=live)
            tl.store(mass_ptr + row * width + j + 1, mass, mask=live)
            tl.store(rmass_ptr + row * width + j + 1, r_mass, mask=live)
        tl.store(kept_ptr + row * SLOTS + slot, kept, mask=in_slots)

    return rejection_states_kernel


def jit_pool_draw():
    """The jitted pool-draw kernel (launch it with ``launch_pool_draw``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def pool_draw_kernel(vals_ptr, temp_ptr, w1_ptr, w2_ptr, drawn_ptr, dvals_ptr, size, rows, level, draws,
                         K: tl.constexpr, S_P2: tl.constexpr):
        """Program r: draft row r = b * rows + i. Ranks its pool by Gumbel key, comparing every pair of
        entries (ties: the lower position first); the K best are the draws, stored in draw order at their
        rank, and their values stored in position order."""
        r = tl.program_id(0)
        b = r // rows
        col = tl.arange(0, S_P2)
        live = col < size
        v = tl.load(vals_ptr + r * size + col, mask=live, other=0.0)
        t = tl.load(temp_ptr + b)
        w1 = tl.load(w1_ptr + b * draws + level)
        w2 = tl.load(w2_ptr + b * draws + level)
        # rng.index_bits: mix32(mix32(index ^ w1) ^ w2), mix32 being lowbias32 on int64 words below 2^32 with
        # each multiplication split into 16-bit halves (rng._mul32), as the torch code computes it
        x = ((r - b * rows) * size + col).to(tl.int64) ^ w1
        for half in tl.static_range(2):
            x = x ^ (x >> 16)
            x = ((x & 0xFFFF) * 0x7FEB352D + (((x >> 16) * 0x352D) << 16)) & 0xFFFFFFFF
            x = x ^ (x >> 15)
            x = ((x & 0xFFFF) * 0x846CA68B + (((x >> 16) * 0xA68B) << 16)) & 0xFFFFFFFF
            x = x ^ (x >> 16)
            if half == 0:
                x = x ^ w2
        bits = x
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = tl.where(live, v / t - tl.log(-tl.log(u)), float("-inf"))
        g_i, g_j = g[:, None], g[None, :]
        i_lt_j = col[:, None] < col[None, :]
        rank = tl.sum(((g_i > g_j) | ((g_i == g_j) & i_lt_j)).to(tl.int32), 0)  # entries ranked before j
        chosen = live & (rank < K)
        tl.store(drawn_ptr + r * K + rank, col.to(tl.int64), mask=chosen)
        place = tl.sum((chosen[:, None] & i_lt_j).to(tl.int32), 0)  # chosen entries before j
        tl.store(dvals_ptr + r * K + place, v, mask=chosen)

    return pool_draw_kernel


# Resolved once at import: a lookup (or an lru_cache) inside a compiled round would break its graph.
_TRITON_TOPK, _TRITON_REJECTION, _TRITON_DRAW = _register()
