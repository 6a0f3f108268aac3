"""Where a prefill's GPU time goes, next to a round's: the captured prefill graphs of a one-row session
(compiled with ``--compile``) and of a batched one (captured from eager kernels), per rows x padded length,
replayed back to back, with the kernel table of one replay of each, and the rounds' replay time.

    python eval/device/prefill_profile.py --compile --batch 8 --out $OUT/prefill.json

Prompts: the first ``--limit`` MT-bench first turns, decoded ``--max-new-tokens`` tokens in one ``generate``
call per session (which captures a prefill graph for every bucket those prompts need), AR and EAGLE-2.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.device.profile_round import replay_ms  # noqa: E402
from eval.tasks import load_mt_bench  # noqa: E402
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402


def graph_kernels(graph: torch.cuda.CUDAGraph, replays: int = 5, top: int = 20) -> dict:
    """The kernels of one replay of ``graph``, by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_time_total > 0 and e.count >= replays]
    rows.sort(key=lambda e: -e.self_device_time_total)
    return {"kernels": sum(e.count for e in rows) / replays,
            "kernel_ms": round(sum(e.self_device_time_total for e in rows) / replays / 1000, 3),
            "top": [{"name": e.key[:90], "per_replay": e.count / replays,
                     "ms": round(e.self_device_time_total / replays / 1000, 4)} for e in rows[:top]]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--compile", action="store_true", help="compiled rounds (and one-row prefills)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--limit", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    gen = SpeculativeGenerator.load(device="cuda", dtype="bfloat16", compile=a.compile)
    prompts = [q.turns[0] for q in load_mt_bench(limit=a.limit)]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "compile": a.compile,
           "command": " ".join(sys.argv), "rows": []}
    for ar in (True, False):
        for batch in (1, a.batch):
            if batch == 1:
                for prompt in prompts:
                    gen.generate(prompt, a.max_new_tokens, autoregressive=ar)
            else:
                gen.generate(prompts, a.max_new_tokens, autoregressive=ar, batch_size=batch)
            session = gen.session(autoregressive=ar, batch=batch)
            row = {"method": "ar" if ar else "eagle2", "batch": batch, "mode": session.mode,
                   "round_replay_ms": round(replay_ms(session.graph[0]), 3) if session.graph else None,
                   "prefills": {}}
            for (rows, size), entry in sorted(session.prefills.items()):
                captured = entry[3]
                if captured is None:
                    row["prefills"][f"{rows}x{size}"] = None
                    continue
                row["prefills"][f"{rows}x{size}"] = {"replay_ms": round(replay_ms(captured[0], 10), 3),
                                                     **graph_kernels(captured[0])}
            out["rows"].append(row)
            print(json.dumps({k: v if k != "prefills" else {n: (e or {}).get("replay_ms") for n, e in v.items()}
                              for k, v in row.items()}), flush=True)
            write_text_atomic(a.out, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
