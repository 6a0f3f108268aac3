"""Small tensor helpers that stay on the device (no host sync, CUDA-graph safe)."""

import torch


def pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[b, i[b]]`` for every row b: x ``[B, n, ...]``, i ``[B]`` -> ``[B, ...]``, as one gather (Python
    indexing with a tensor would sync with the host)."""
    index = i.view((-1, 1) + (1,) * (x.dim() - 2)).expand((x.shape[0], 1) + tuple(x.shape[2:]))
    return x.gather(1, index).squeeze(1)
