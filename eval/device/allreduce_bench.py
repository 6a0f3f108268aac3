"""Cost of one all-reduce inside a captured CUDA graph, the form it takes in a tensor-parallel round: each
rank replays a graph of ``--reps`` iterations of {a row-parallel matmul [n, k/N] x [k/N, h] -> sum over the
ranks}, for n = 1 (a decoding step) and n = 64 (a 64-node tree), and the same graph without the all-reduce;
the difference per iteration is what one all-reduce adds. Variants of the sum:

- ``dist``: ``torch.distributed.all_reduce`` in place (NCCL; what transformers' row-parallel layers call);
- ``symm``: ``fsd_eagle.tp_allreduce.tp_all_reduce`` (what ``FSD_EAGLE_TP_ALLREDUCE=symm`` makes the target's
  row-parallel layers call): PyTorch's symmetric-memory one-shot all-reduce where this torch build has it
  and the ranks' memory can be mapped (NVLink P2P; multicast stays off), else the same NCCL sum.

Every variant's sums are checked against ``dist``'s on the same inputs first. Sharded shapes of a Llama-3-8B
layer's o_proj by default (k = 4096, h = 4096, N = world size).

    torchrun --nproc-per-node 2 eval/device/allreduce_bench.py --out $OUT/allreduce.json

On a machine without CUDA it runs the dist variant over gloo without graphs (a smoke run of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402


def dist_sum(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def graph_us(fn, reps: int, device: torch.device) -> float:
    """Microseconds per iteration of ``fn`` replayed ``reps`` times in one CUDA graph (5 replays timed)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) * 1000 / (5 * reps)


def wall_us(fn, reps: int) -> float:
    dist.barrier()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) * 1e6 / reps


def bench(rows: int, k: int, h: int, reps: int, device: torch.device, dtype: torch.dtype) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator(device="cpu").manual_seed(rank)
    x = torch.randn(rows, k // world, generator=gen).to(device, dtype)
    w = (torch.randn(k // world, h, generator=gen) / k ** 0.5).to(device, dtype)
    out = torch.empty(rows, h, device=device, dtype=dtype)
    from fsd_eagle import tp_allreduce

    group = tp_allreduce.use_group(dist.group.WORLD)
    variants = {"dist": dist_sum, "symm": lambda y: tp_allreduce.tp_all_reduce(y, group)}
    notes = {}
    reference = dist_sum(x @ w)
    got = variants["symm"](x @ w)  # the first sum sets up the symmetric buffer (before any capture)
    if not tp_allreduce.symmetric(group):
        notes["symm"] = "no symmetric memory here: the op summed with torch.distributed"
    if not torch.equal(got, reference):
        notes["symm"] = f"sums differ from torch.distributed.all_reduce's (max {float((got - reference).abs().max()):.3g}); not timed"
        del variants["symm"]

    def matmul_only():
        torch.matmul(x, w, out=out)
        return out

    timer = (lambda fn: graph_us(fn, reps, device)) if device.type == "cuda" else (lambda fn: wall_us(fn, reps))
    base = timer(matmul_only)
    row = {"rows": rows, "k_per_rank": k // world, "h": h, "message_bytes": rows * h * out.element_size(),
           "matmul_us": round(base, 2)}
    for name, fn in variants.items():
        total = timer(lambda fn=fn: fn(torch.matmul(x, w, out=out)))
        row[f"{name}_us"] = round(total, 2)
        row[f"{name}_allreduce_us"] = round(total - base, 2)
    return {**row, **({"notes": notes} if notes else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N eval/device/allreduce_bench.py")
    p.add_argument("--out", required=True)
    p.add_argument("--rows", default="1,64", help="comma-separated rows per all-reduce (1: a step, 64: a tree)")
    p.add_argument("--k", type=int, default=4096, help="the matmul's full input width (split over the ranks)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--reps", type=int, default=64, help="iterations per graph (2 per layer x 32 layers = 64)")
    p.add_argument("--code", help="the commit of the code run, recorded in the result")
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: launch with torchrun --nproc-per-node N (N >= 2)", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = [bench(int(n), a.k, a.hidden, a.reps, device, dtype) for n in a.rows.split(",")]
    if dist.get_rank() == 0:
        from eval.runinfo import git_commit, versions

        result = {"date": date.today().isoformat(), "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                  "world": dist.get_world_size(), **versions(), "code": a.code or git_commit(short=True),
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                  "command": "torchrun --nproc-per-node " + str(dist.get_world_size()) +
                             " eval/device/allreduce_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                  "graphs": cuda, "dtype": str(dtype).removeprefix("torch."), "rows": rows}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.out, json.dumps(result, indent=2) + "\n")
        print(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: on the CPU (gloo), a rank sometimes aborted there after a clean
    # destroy_process_group ("terminate called without an active exception", a backend thread destroyed while
    # joinable), after the results had been written. Nothing is left to write or free at this point.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
