"""Tensor-parallel targets: the target is sharded by transformers' own tensor parallelism (``from_pretrained``
with ``DistributedConfig(tp_size=N)``: its ``base_model_tp_plan`` over a PyTorch device mesh, DTensor
weights, NCCL collectives on GPUs, gloo on the CPU), one process per GPU as ``torchrun --nproc-per-node N``
starts them. Nothing here shards a weight.

What each rank holds: its share of the target's attention heads (so its slot KV cache has
``num_key_value_heads / N`` heads, see ``Target.num_kv_heads``) and of the MLP; the lm_head is split over the
vocabulary and gathered after each forward (transformers' ``colwise_gather_output``), so every rank sees the
same logits and takes the same decisions. The draft head (or draft model) is replicated; an EAGLE head reads
token embeddings through a full copy of the embedding table (``ReplicatedEmbedding``). With a draft vocabulary
it drafts from lm_head rows gathered once (``SlotDrafter.use_vocab``), so drafting runs no collective; over the
whole vocabulary it shares the target's sharded lm_head, whose logits are gathered for every tree level after
the first and after every commit (depth all-gathers per round). A target forward runs two all-reduces per decoder layer, one all-gather of the logits
and, where transformers shards the embedding over the vocabulary, one more all-reduce for it (counted on two
gloo ranks with transformers 5.24: 2 x layers + 1 all-reduces and 1 all-gather per forward). Every rank runs the same rounds; only rank 0 reports
(``is_main_rank``).
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConfigError

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel launch: ``size`` ranks, this one ``rank`` (``local_rank`` on
    its host) on ``device``."""

    size: int
    rank: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_tp_size(tp_size) -> None:
    """A tensor-parallel size is an integer >= 1."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_size must be an integer >= 1, got {tp_size!r}")


def launched_world() -> int | None:
    """The number of processes of a torchrun launch (its RANK, WORLD_SIZE and LOCAL_RANK variables), or None
    when this process was not started that way."""
    if not all(os.environ.get(name) for name in LAUNCH_ENV):
        return None
    try:
        return int(os.environ["WORLD_SIZE"])
    except ValueError:
        raise ConfigError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from None


def check_launch(tp_size: int) -> int:
    """The launch's process count, refused (ConfigError) unless this process was started by torchrun with
    ``tp_size`` processes and torch has torch.distributed."""
    import torch.distributed as dist

    check_tp_size(tp_size)
    world = launched_world()
    if world is None:
        raise ConfigError(f"tp_size {tp_size} needs one process per GPU: launch with torchrun --nproc-per-node "
                          f"{tp_size} (RANK, WORLD_SIZE and LOCAL_RANK are not set)")
    if world != tp_size:
        raise ConfigError(f"this launch has {world} processes (WORLD_SIZE) but tp_size is {tp_size}: they must be "
                          f"equal (torchrun --nproc-per-node {tp_size})")
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed: tensor parallelism is not possible")
    return world


def run_ranks(command: list[str], tp_size: int, grace_s: float = 10.0) -> int:
    """Run ``command`` (this program again) as the ``tp_size`` processes of one launch on this machine, as
    torchrun would start them (RANK, LOCAL_RANK, WORLD_SIZE and a free rendezvous port in the environment),
    each with this process's stdout and stderr, and wait for all of them. Returns the launch's exit status:
    rank 0's, else (rank 0 succeeded or was stopped) the first failed rank's; a rank killed by signal s
    counts as 128 + s, as a shell reports it. When one rank fails the others get ``grace_s``
    seconds to end (a rank waiting in a collective for the failed one never would) before they are stopped;
    Ctrl-C is passed on to every rank. Every rank that failed gets one line on stderr (``describe_rank_end``),
    first the one that failed first: a rank that lost its peer only reports a closed connection, and which
    rank ended how (an exit status, or a signal such as SIGSEGV, which leaves no traceback) is the cause."""
    import signal
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(tp_size),
           "LOCAL_WORLD_SIZE": str(tp_size)}
    ranks = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(tp_size)]
    failed_at = None
    failed_first: list[int] = []  # the ranks in the order their failure was seen
    stopped: set[int] = set()  # the ranks killed here after another one failed
    try:
        while None in [p.poll() for p in ranks]:  # every rank polled (any() would stop at the first alive)
            for r, p in enumerate(ranks):
                if p.returncode not in (None, 0) and r not in failed_first:
                    failed_first.append(r)
            if failed_at is None and failed_first:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for r, p in enumerate(ranks):
                    if p.poll() is None:
                        p.kill()
                        stopped.add(r)
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in ranks:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in ranks:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
        return 130
    codes = [p.wait() for p in ranks]
    failed_first += [r for r, c in enumerate(codes) if c and r not in failed_first]
    for r in failed_first:
        print(describe_rank_end(r, tp_size, codes[r], stopped=r in stopped), file=sys.stderr)
    if not failed_first:
        return 0
    first = 0 if codes[0] and 0 not in stopped else failed_first[0]
    return codes[first] if codes[first] > 0 else 128 - codes[first]  # a signal as a shell reports it


def describe_rank_end(rank: int, tp_size: int, code: int, stopped: bool = False) -> str:
    """One line on how rank ``rank`` of a launch ended: ``code`` is its process's exit status as subprocess
    reports it (negative: killed by that signal); ``stopped``: killed by ``run_ranks`` after another rank
    failed."""
    import signal

    if stopped:
        how = "was stopped after another rank failed"
    elif code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"was killed by {name}"
    else:
        how = f"ended with exit status {code}"
    return f"fsd-eagle: rank {rank} of {tp_size} {how}"


def start(tp_size: int, device: str | None = None) -> TensorParallel:
    """Join the process group of this torchrun launch of ``tp_size`` processes (started here unless the
    caller did, and then destroyed when the process exits, ``leave``): NCCL on GPUs (rank r on
    cuda:LOCAL_RANK), gloo on a machine without CUDA. A ConfigError (one line) when the launch and ``tp_size``
    differ, when the process was not started by torchrun, or when the backend the device needs is missing."""
    import torch.distributed as dist

    world = check_launch(tp_size)
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    dev = rank_device(device, local)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    check_backend(backend)
    if dist.is_initialized():
        if dist.get_world_size() != tp_size:
            raise ConfigError(f"the process group has {dist.get_world_size()} ranks but tp_size is {tp_size}")
        if dev.type == "cuda" and "nccl" not in str(dist.get_backend()).lower():
            raise ConfigError(f"the process group uses {dist.get_backend()}: tensor parallelism on GPUs needs NCCL")
    else:
        dist.init_process_group(backend, rank=rank, world_size=world,
                                **({"device_id": dev} if dev.type == "cuda" else {}))
        atexit.register(leave)
    return TensorParallel(tp_size, rank, local, dev)


def leave() -> None:
    """Destroy the process group ``start`` joined, before the interpreter exits: one left to the process's
    teardown can abort it there ("terminate called without an active exception", the rank's exit status
    SIGABRT after its work was done)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def rank_device(device: str | None, local_rank: int) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK (made current) for "cuda", "cuda:LOCAL_RANK" or None where CUDA
    is available; the CPU only on a machine without CUDA (transformers shards onto the machine's accelerator)."""
    cuda = torch.cuda.is_available()
    if device in (None, "auto"):
        device = "cuda" if cuda else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ConfigError(f"unknown device {device!r}; use cpu or cuda") from None
    if dev.type == "cpu":
        if cuda:
            raise ConfigError("tensor parallelism shards onto this machine's GPUs: use device cuda, not cpu")
        return dev
    if dev.type != "cuda":
        raise ConfigError(f"unsupported device {device!r} for tensor parallelism; use cuda")
    if not cuda:
        raise ConfigError(f"device {device!r} requested but CUDA is not available on this machine")
    if dev.index is not None and dev.index != local_rank:
        raise ConfigError(f"with tensor parallelism each process uses cuda:LOCAL_RANK; this one is cuda:{local_rank}, "
                          f"not {device} (pass cuda)")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"rank with LOCAL_RANK {local_rank} has no GPU: this machine has "
                          f"{torch.cuda.device_count()}")
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    return dev


def check_backend(backend: str) -> None:
    """Refuse a torch build without the collective backend the device needs (NCCL for CUDA, gloo for CPU)."""
    import torch.distributed as dist

    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        where = "GPUs" if backend == "nccl" else "the CPU"
        raise ConfigError(f"tensor parallelism on {where} needs the {backend.upper()} backend, which this torch "
                          "build lacks")


def check_divides(config, tp_size: int) -> None:
    """Refuse a tensor-parallel size that does not divide the model's attention heads, key-value heads or
    vocabulary (each rank holds an equal share of each)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    for count, what in ((heads, "attention heads"), (kv_heads, "key-value heads"),
                        (int(text.vocab_size), "vocabulary entries")):
        if count % tp_size:
            raise ConfigError(f"tp_size {tp_size} does not divide the model's {count} {what}")


def distributed_config(tp_size: int, config=None):
    """transformers' DistributedConfig for a tensor-parallel load with the model's own plan, or with
    ``FSD_EAGLE_TP_ALLREDUCE=symm`` the same plan summing row-parallel outputs through
    ``fsd_eagle.tp_allreduce`` (needs the model's ``config``)."""
    from transformers.distributed import DistributedConfig

    from . import tp_allreduce

    if tp_allreduce.mode() == "symm" and config is not None:
        tp_allreduce.register_style()
        return DistributedConfig(tp_size=tp_size, tp_plan=tp_allreduce.symm_plan(config))
    return DistributedConfig(tp_size=tp_size)


def tp_size_of(model: nn.Module) -> int:
    """How many ranks share ``model``'s weights: the mesh size of its first sharded (DTensor) weight, 1 when
    none is."""
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            return int(mesh.size())
    return 1


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a weight that transformers distributed over ranks)."""
    return getattr(tensor, "device_mesh", None) is not None


def replicated(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a DTensor on every rank (a collective: every rank must call it), or ``tensor`` itself
    when it is a plain tensor."""
    return tensor.full_tensor() if is_sharded(tensor) else tensor


class ReplicatedEmbedding(nn.Module):
    """A full copy of a sharded embedding table, for a drafter's lookups without collectives: ids ``[...]``
    -> embeddings ``[..., h]``, scaled like the model's (Gemma's ``embed_scale``)."""

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.weight = nn.Parameter(replicated(embedding.weight).detach(), requires_grad=False)
        self.padding_idx = getattr(embedding, "padding_idx", None)
        scale = getattr(embedding, "embed_scale", None)
        self.scale = None if scale is None else torch.as_tensor(scale).to(self.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = F.embedding(ids, self.weight, self.padding_idx)
        return out if self.scale is None else out * self.scale.to(out.device)


def drafting_embedding(model: nn.Module) -> nn.Module:
    """The embedding a drafter reads: the model's own, or a replicated copy when transformers sharded it."""
    embedding = model.get_input_embeddings()
    return ReplicatedEmbedding(embedding) if is_sharded(embedding.weight) else embedding


def broadcast_module(module: nn.Module, src: int = 0) -> nn.Module:
    """Give every rank rank ``src``'s weights of ``module`` (e.g. a randomly initialised head, which each
    rank would otherwise draw for itself); nothing without a process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in module.state_dict().values():
                dist.broadcast(tensor, src)
    return module


def is_main_rank() -> bool:
    """Whether this process reports: rank 0 of a process group, or a process without one."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def share(obj, src: int = 0):
    """Rank ``src``'s ``obj`` (picklable) on every rank; ``obj`` itself without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]
