"""The sum of a tensor-parallel target's row-parallel outputs, optionally through PyTorch's symmetric memory.

transformers' tensor parallelism sums the partial outputs of each row-parallel linear (a Llama layer's o_proj
and down_proj: two sums per decoder layer) with ``torch.distributed.all_reduce``, NCCL on GPUs. In a
decoding round these are messages of a few KiB (one token) to a few MiB (a batch of trees), where a sum
costs its latency rather than its bytes. With ``FSD_EAGLE_TP_ALLREDUCE=symm`` the target is loaded with the
same plan except that its row-parallel layers use the style ``rowwise_symm``: transformers' RowwiseParallel
whose sum is the op ``fsd_eagle::tp_all_reduce``, which sums messages up to ``SYMM_MAX_BYTES`` with PyTorch's
symmetric-memory one-shot all-reduce (one kernel that reads every rank's buffer over NVLink; no multicast)
and anything else (longer prefills, the CPU, gloo) with ``torch.distributed.all_reduce``. Every rank gets the
same sum either way. ``eval/device/allreduce_bench.py`` measures both sums; the default stays NCCL until
measured faster on a target.

The op is opaque to torch.compile (a fake kernel gives its shape), and the symmetric buffer is set up at the
first sum of each process group, an eager call before any CUDA graph capture (every rank makes the same
calls in the same order, as the setup's exchange between ranks needs).
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from .errors import ConfigError

MODE_ENV = "FSD_EAGLE_TP_ALLREDUCE"
MODES = ("nccl", "symm")
STYLE = "rowwise_symm"
SYMM_MAX_BYTES = 8 * 2**20  # a batch of 8 trees of 64 tokens of a 4096-wide bf16 model is 4 MiB

_groups: dict[str, "dist.ProcessGroup"] = {}  # process groups by name, as the op receives them
_buffers: dict[str, torch.Tensor | None] = {}  # symmetric buffer per group (None: unavailable, use NCCL)
calls = 0  # sums made by the op in eager calls (compiled code and graph replays do not count)


def mode() -> str:
    """The sum that tensor-parallel loads use: ``FSD_EAGLE_TP_ALLREDUCE`` ("nccl", the default, or "symm")."""
    value = os.environ.get(MODE_ENV, "").strip().lower() or "nccl"
    if value not in MODES:
        raise ConfigError(f"{MODE_ENV} must be nccl or symm, got {value!r}")
    return value


def _symmetric_buffer(group_name: str, like: torch.Tensor) -> torch.Tensor | None:
    """The group's symmetric buffer of SYMM_MAX_BYTES (made and exchanged between the ranks on first use),
    or None where this torch or machine cannot make one (then the group sums with torch.distributed)."""
    if group_name not in _buffers:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(SYMM_MAX_BYTES // like.element_size(), dtype=like.dtype, device=like.device)
            symm_mem.rendezvous(buf, group_name)
            _buffers[group_name] = buf
        except (RuntimeError, AttributeError, ImportError, NotImplementedError) as e:
            warnings.warn(f"symmetric memory is unavailable ({type(e).__name__}: {e}); summing with NCCL",
                          stacklevel=2)
            _buffers[group_name] = None
    return _buffers[group_name]


def use_group(group: "dist.ProcessGroup") -> str:
    """Make ``group`` known to ``tp_all_reduce`` (which receives groups by name); returns its name."""
    _groups.setdefault(group.group_name, group)
    return group.group_name


def symmetric(group_name: str) -> bool:
    """Whether the group's sums up to SYMM_MAX_BYTES go through symmetric memory (known after its first)."""
    return _buffers.get(group_name) is not None


@torch.library.custom_op("fsd_eagle::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the ranks of process group ``group_name`` of ``x`` (any shape), as a new tensor."""
    global calls
    calls += 1
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float32) and x.numel() * x.element_size() <= SYMM_MAX_BYTES:
        buf = _symmetric_buffer(group_name, x)
        if buf is not None and buf.dtype == x.dtype:
            flat = x.contiguous().view(-1)
            out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:flat.numel()], flat, "sum", group_name)
            return out.view(x.shape)
    out = x.clone()
    dist.all_reduce(out, group=_groups[group_name])
    return out


@tp_all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _rowwise_class():
    from torch.distributed.tensor import DTensor, Replicate
    from transformers.distributed.tensor_parallel import RowwiseParallel

    class SymmRowwiseParallel(RowwiseParallel):
        """transformers' RowwiseParallel whose local inference path (a plain Linear without gradients) sums
        with ``tp_all_reduce``; every other path is the base class's. Arguments after ``mesh`` (transformers
        5.25 added ``config=``) pass through to the base class unread, so later additions do not break it."""

        def transform_output_post_forward(self, module, output, mesh, *args, **kwargs):
            local = (isinstance(module, nn.Linear) and not isinstance(output, DTensor)
                     and isinstance(self.output_layouts, Replicate) and not output.requires_grad)
            if not local:
                return super().transform_output_post_forward(module, output, mesh, *args, **kwargs)
            group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group("tp")
            output = tp_all_reduce(output, use_group(group))
            if (bias := module._parameters.get("bias")) is not None:
                output = output + (bias.to_local() if isinstance(bias, DTensor) else bias)
            return output

    return SymmRowwiseParallel


def register_style() -> None:
    """Make ``rowwise_symm`` a tensor-parallel style transformers knows (once)."""
    from torch.distributed.tensor import Replicate, Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    if STYLE not in ALL_PARALLEL_STYLES:
        ALL_PARALLEL_STYLES.register(STYLE, _rowwise_class()(input_layouts=Shard(-1), output_layouts=Replicate()))


def symm_plan(config) -> dict[str, str]:
    """The whole tensor-parallel plan of the model ``config`` describes, its ``rowwise`` layers as
    ``rowwise_symm`` (the whole plan: some transformers versions replace the model's plan with the one given)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        plan = dict(AutoModelForCausalLM.from_config(config, trust_remote_code=False).tp_plan)
    if "rowwise" not in plan.values():
        raise ConfigError(f"{MODE_ENV}=symm: this model's tensor-parallel plan has no row-parallel layer")
    return {key: STYLE if style == "rowwise" else style for key, style in plan.items()}
