"""Quick GPU check: a round has no host sync (sync debug mode), CUDA-graph rounds give the same tokens as
eager rounds, and how long a round takes either way."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.decode import run_round  # noqa: E402
from fsd_eagle.verify import AcceptanceRule  # noqa: E402

gen = SpeculativeGenerator.load(device="cuda", dtype="bfloat16")
prompt = "Explain how a transformer language model generates text, step by step."
gen.cuda_graphs = False
gen.generate(prompt, 32)
runner = next(iter(gen._runners.values()))
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    run_round(gen.target, gen.drafter, runner.state, gen.tree, AcceptanceRule(), None)
    print("round without host sync: ok")
except RuntimeError as e:
    print("host sync inside a round:", e)
finally:
    torch.cuda.set_sync_debug_mode("default")
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
