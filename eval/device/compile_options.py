"""Which inductor options make the target's tree forward cheaper (the round's largest stage)?

Times the compiled target forward (+ lm_head) over n tree nodes (a chain mask) as a replayed CUDA graph,
for several torch.compile settings, with FlexAttention as in compiled rounds. Each setting compiles anew.

    python eval/device/compile_options.py --nodes 1,48 --out $OUT/compile_options.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402
from profile_round import replay_ms  # noqa: E402

SETTINGS = {
    "default": {},
    "freezing": {"freeze": True},  # q/k/v and gate/up matmuls fused (FSD_EAGLE_INDUCTOR_FREEZING in rounds)
    "coordinate_descent": {"options": {"coordinate_descent_tuning": True}},
    "max_autotune": {"mode": "max-autotune-no-cudagraphs"},
}


def forward_ms(gen, n: int, setting: dict, reps: int = 50) -> float:
    target = gen.target
    target.allocate(2048)
    target.prefill(torch.arange(100, 400, device=target.device)[None])
    tokens = torch.arange(500, 500 + n, device=target.device)[None]  # one batch row: [1, n]
    depths = torch.arange(n, device=target.device)[None]
    anc = torch.ones(1, n, n, dtype=torch.bool, device=target.device).tril()

    def fn():
        return target.logits(target.forward_tree(tokens, depths, anc))

    torch._dynamo.reset()
    setting = dict(setting)
    # freezing as a config patch around the compiling calls (as fsd_eagle.decode._compile does), under no_grad
    freeze = setting.pop("freeze", False)
    compiled = torch.compile(fn, dynamic=False, **setting)
    with torch._inductor.config.patch(freezing=freeze), torch.no_grad():
        for _ in range(2):
            compiled()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            compiled()
    return replay_ms(graph, reps)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", default="1,48")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--out", required=True)
    a = p.parse_args()
    gen = SpeculativeGenerator.load(device="cuda", dtype="bfloat16")
    gen.target.use_attention("flex")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name in a.settings.split(","):
        for n in map(int, a.nodes.split(",")):
            t = time.perf_counter()
            ms = forward_ms(gen, n, SETTINGS[name])
            out["rows"].append({"setting": name, "nodes": n, "ms": round(ms, 3),
                                "compile_s": round(time.perf_counter() - t, 1)})
            print(json.dumps(out["rows"][-1]), flush=True)
            write_text_atomic(a.out, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
