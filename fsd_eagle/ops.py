"""Small tensor helpers that stay on the device (no host sync, CUDA-graph safe): ``pick``, ``first_argmax``,
and the vocabulary projection ``project``."""

import torch
import torch.nn.functional as F


def pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[b, i[b]]`` for every row b: x ``[B, n, ...]``, i ``[B]`` -> ``[B, ...]``, as one gather (Python
    indexing with a tensor would sync with the host)."""
    index = i.view((-1, 1) + (1,) * (x.dim() - 2)).expand((x.shape[0], 1) + tuple(x.shape[2:]))
    return x.gather(1, index).squeeze(1)


#: ``first_argmax`` reduces vectors longer than two such chunks in two stages.
ARGMAX_CHUNK = 1024


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximum of each row, as torch returns it) in two stages for long rows: the
    maximum of each chunk of ARGMAX_CHUNK entries, then the first chunk holding the row's maximum. The index
    is the same; the point is the GPU's work: a compiled argmax over one long row (a sampled token from one
    distribution over the vocabulary) runs as one thread block that also computes every element's inputs
    (the race's random numbers), while [rows, chunks] chunk maxima spread over as many blocks as chunks.
    x ``[..., V]`` of a floating type; rows of all -inf or NaN behave as in torch's argmax only where V is
    at most two chunks."""
    v = x.shape[-1]
    if v <= 2 * ARGMAX_CHUNK:
        return x.argmax(-1)
    pad = -v % ARGMAX_CHUNK
    if pad:  # -inf after the row's last entry never comes first
        x = F.pad(x, (0, pad), value=float("-inf"))
    best, within = x.unflatten(-1, (-1, ARGMAX_CHUNK)).max(-1)  # [..., chunks]: each chunk's first maximum
    chunk = best.argmax(-1, keepdim=True)  # the first chunk with the row's maximum holds its first maximum
    return (chunk * ARGMAX_CHUNK + within.gather(-1, chunk)).squeeze(-1)


#: A CPU projection onto at most this many rows, by a weight of at least LARGE_WEIGHT elements, runs as
#: ``weight @ x.T`` (``project``).
FEW_ROWS = 8
LARGE_WEIGHT = 1 << 22


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``[..., K]``, weight ``[N, K]`` -> ``[..., N]``, for vocabulary
    projections (lm_heads). On the CPU in float32, for at most FEW_ROWS rows and a weight of at least
    LARGE_WEIGHT elements (one that does not stay in the caches), it runs as ``weight @ x.T`` (one row padded
    to two): the math library's few-row ``x @ weight.T`` streams the weight once per row. Measured on a
    2-core AMD EPYC (float32, one thread, SmolLM2's 49,152 x 576 lm_head): 1 / 2 / 3 / 4 / 8 rows took 9.3 /
    21.0 / 31.4 / 16.4 / 18.8 ms as F.linear and 5.4 / 5.4 / 8.0 / 7.5 / 14.1 ms this way; from 12 rows on,
    F.linear was as fast or faster. Values agree with F.linear up to float rounding (another summation
    order). Code that torch.compile traces always takes F.linear (compiled rounds: GPUs, and the CPU's
    compiled reference path)."""
    # Static properties first: under torch.compile (or with a symbolic batch) the row count is never read,
    # so no guard on it is installed.
    transposed = (not torch.compiler.is_compiling() and x.device.type == "cpu" and x.dtype == torch.float32
                  and weight.dtype == torch.float32 and weight.numel() >= LARGE_WEIGHT
                  and x.numel() <= FEW_ROWS * x.shape[-1])
    if not transposed:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    out = torch.mm(weight, flat.T).T[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])
