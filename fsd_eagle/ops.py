"""Small tensor helpers that stay on the device (no host sync, CUDA-graph safe)."""

import torch


def pick(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``x[i]`` for a 0-dim index tensor, without the host sync that Python indexing with a tensor does."""
    return x.index_select(0, i.reshape(1)).squeeze(0)
