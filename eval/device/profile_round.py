"""Where the time of a decoding call goes on a GPU, per tree-attention backend (compiled rounds + graphs).

For each backend and method (AR, EAGLE-2): tokens/s over MT-bench first turns, time to the first token
(prefill), wall ms per round after it, and ms per round when the captured round is replayed back to back
(the GPU's own time: the difference is host overhead), the rest of a call after its last round, and the
prefill graphs per length bucket (replay ms; buckets left eager). Then a kernel table of one EAGLE-2 round.

    python eval/device/profile_round.py --backends sdpa,flex --out $OUT/profile.json [--trace $OUT/round]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.tasks import load_mt_bench  # noqa: E402
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.config import TreeConfig  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402


def replay_ms(graph: torch.cuda.CUDAGraph, rounds: int = 20) -> float:
    """GPU ms per replay of a captured graph, replayed back to back (a round's state advances as in decoding)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / rounds


def kernel_table(session, rounds: int = 5, top: int = 25) -> dict:
    """The kernels of ``session``'s captured round, by GPU time per round."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = session.graph
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            graph.replay()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0 and e.count >= rounds]
    total = sum(e.self_device_time_total for e in rows) / rounds / 1000
    rows.sort(key=lambda e: -e.self_device_time_total)
    return {"kernels_per_round": sum(e.count for e in rows) / rounds, "kernel_ms_per_round": round(total, 3),
            "top": [{"name": e.key[:90], "per_round": e.count / rounds,
                     "ms_per_round": round(e.self_device_time_total / rounds / 1000, 4)} for e in rows[:top]]}


def export_trace(session, path: str) -> None:
    """Chrome trace of one replayed EAGLE-2 round: every kernel in launch order with its duration."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = session.graph
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", default="sdpa,flex")
    p.add_argument("--limit", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", help="total/depth/top_k (default: the device's preset)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--trace", help="also write a chrome trace of one EAGLE-2 round (per backend) to TRACE.<backend>.json")
    a = p.parse_args()
    tree = TreeConfig.parse(a.tree) if a.tree else None
    gen = SpeculativeGenerator.load(device="cuda", dtype="bfloat16", tree=tree, compile=not a.no_compile)
    prompts = [q.turns[0] for q in load_mt_bench(limit=a.limit)]
    out = {"tree": str(gen.tree), "compile": not a.no_compile, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rows": []}
    for backend in a.backends.split(","):
        gen.use_attention(backend)
        for name, ar in (("ar", True), ("eagle2", False)):
            t = time.perf_counter()
            gen.generate(max(prompts, key=len), a.max_new_tokens, autoregressive=ar)
            warm = time.perf_counter() - t
            for prompt in prompts:  # prefill graphs of every length bucket
                gen.generate(prompt, 2, autoregressive=ar)
            tokens = secs = 0.0
            prefill, per_round, taus, calls, tails = [], [], [], [], []
            for prompt in prompts:
                torch.cuda.synchronize()
                t = time.perf_counter()
                r = gen.generate(prompt, a.max_new_tokens, autoregressive=ar)
                torch.cuda.synchronize()
                call = time.perf_counter() - t
                secs += call
                s = r.stats
                tokens += s.new_tokens
                calls.append(call * 1000)
                tails.append((call - s.elapsed_s) * 1000)
                prefill.append(s.prefill_s * 1000)
                per_round.append(1000 * (s.elapsed_s - s.prefill_s) / max(1, s.target_forwards - 1))
                taus.append(s.tau)
            session = gen.session(autoregressive=ar)  # the one generate() uses
            gen.generate(prompts[0], 1, autoregressive=ar)  # fresh state: replays below decode after a prefill
            prefills = {f"{rows}x{size}": entry[3] for (rows, size), entry in session.prefills.items()}
            row = {"backend": backend, "method": name, "warmup_s": round(warm, 1), "tokens_per_s": round(tokens / secs, 1),
                   "tau": round(statistics.mean(taus), 3), "call_ms": round(statistics.mean(calls), 2),
                   "prefill_ms": round(statistics.mean(prefill), 2),
                   "wall_ms_per_round": round(statistics.mean(per_round), 3),
                   "replay_ms_per_round": round(replay_ms(session.graph[0]), 3) if session.graph else None,
                   # from the last round read to the end of the call (the round launched in vain, the text)
                   "tail_ms": round(statistics.mean(tails), 2),
                   "prefill_buckets": sorted(prefills),
                   "prefill_buckets_eager": sorted(k for k, v in prefills.items() if v is None),
                   "prefill_replay_ms": {k: round(replay_ms(v[0], 5), 3) for k, v in sorted(prefills.items()) if v}}
            if not ar and session.graph:
                gen.generate(prompts[0], 1)
                row["kernels"] = kernel_table(session)
                if a.trace:
                    export_trace(session, f"{a.trace}.{backend}.json")
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            write_text_atomic(a.out, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
