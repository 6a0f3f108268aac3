"""Data-parallel head training over several GPUs (or CPU processes): ``torchrun --nproc-per-node N -m training
run ...`` starts N processes; each holds the target and a replica of the head, trains on its own share of every
epoch's batches (batch i goes to process i mod N, so a step takes N batches of ``tokens_per_batch`` tokens),
and the gradients are averaged over the processes (one all-reduce of the flattened gradients per step, NCCL on
GPUs, gloo on the CPU) before every process takes the same optimizer step, so the replicas stay identical.
Self-distillation is shared the same way (``distill.distill_shared``); process 0 caches the answers, writes
checkpoints, validates and exports. What
goes over the wire is PyTorch's own ``torch.distributed``; nothing here shards a model.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from fsd_eagle.errors import ConfigError

# Long enough for process 0's self-distillation (tens of minutes for large sets) while the others wait.
TIMEOUT = datetime.timedelta(hours=6)


@dataclass(frozen=True)
class Ranks:
    """This process's place among ``world`` data-parallel processes."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1


def launched() -> bool:
    """Whether torchrun started this process as one of several (WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def join(device: torch.device) -> tuple[Ranks, torch.device]:
    """Join this torchrun launch's process group (NCCL on CUDA, gloo on the CPU) and return this process's
    place and device (``cuda:LOCAL_RANK`` on GPUs). A process not started as one of several gets Ranks() and
    ``device`` unchanged."""
    if not launched():
        return Ranks(), device
    import torch.distributed as dist

    try:
        world, rank, local = (int(os.environ[k]) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"))
    except (KeyError, ValueError):
        raise ConfigError("a data-parallel run needs RANK, WORLD_SIZE and LOCAL_RANK (start it with torchrun)") from None
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise ConfigError(f"process {rank} has LOCAL_RANK {local} but this host has {torch.cuda.device_count()} "
                              "GPUs: start at most one process per GPU")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
    return Ranks(world, rank, local), device


def barrier(ranks: Ranks) -> None:
    """Every process waits here for the others (nothing when alone)."""
    if ranks.parallel:
        import torch.distributed as dist

        dist.barrier()


def average_gradients(params, ranks: Ranks) -> None:
    """Replace each parameter's gradient by its mean over the processes: one all-reduce of all gradients
    flattened into one buffer. A parameter without a gradient counts as zeros (every process must flatten
    the same list)."""
    if not ranks.parallel:
        return
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)
    flat /= ranks.world
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset: offset + n].view_as(g).to(g.dtype)
        offset += n


def sum_over(tensor: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """The element-wise sum of ``tensor`` over the processes (a new tensor; ``tensor`` itself when alone)."""
    if not ranks.parallel:
        return tensor
    import torch.distributed as dist

    total = tensor.clone()
    dist.all_reduce(total)
    return total


def from_main(value: int, ranks: Ranks, device: torch.device) -> int:
    """Process 0's ``value`` on every process (a decision all must take alike: when to stop, how long)."""
    if not ranks.parallel:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return int(t.item())


def gather_objects(obj, ranks: Ranks) -> list:
    """Every process's ``obj`` (picklable), in rank order, on every process."""
    if not ranks.parallel:
        return [obj]
    import torch.distributed as dist

    out = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out


def check_in_sync(module: torch.nn.Module, ranks: Ranks) -> None:
    """Raise (RuntimeError) unless every process holds the same weights: each process's float64 sum of
    every parameter, compared over the processes (replicas that drifted apart would train different heads)."""
    if not ranks.parallel:
        return
    total = sum(float(p.detach().double().sum()) + float(p.detach().double().abs().sum()) for p in module.parameters())
    sums = gather_objects(total, ranks)
    if any(s != sums[0] for s in sums):
        raise RuntimeError(f"data-parallel replicas differ (parameter sums {sums}): gradients were not averaged alike")


def leave(ranks: Ranks) -> None:
    """Leave the process group at the end of a run."""
    if ranks.parallel:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
