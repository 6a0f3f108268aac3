"""Quick GPU check: CUDA-graph rounds give the same tokens as eager rounds, and how long a round takes."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402

gen = SpeculativeGenerator.load(device="cuda", dtype="bfloat16")
prompt = "Explain how a transformer language model generates text, step by step."
for ar in (True, False):
    res = {}
    for graphs in (False, True):
        gen.cuda_graphs = graphs
        gen.generate(prompt, 128, autoregressive=ar)
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = gen.generate(prompt, 128, autoregressive=ar)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        res[graphs] = r.token_ids
        print(f"{'AR' if ar else 'EAGLE-2'} graphs={graphs}: {r.stats.new_tokens / dt:.1f} tok/s, tau {r.stats.tau:.2f}, "
              f"{1000 * dt / r.stats.target_forwards:.2f} ms/round")
    print("identical:", res[False] == res[True])
