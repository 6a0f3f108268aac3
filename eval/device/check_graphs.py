"""Quick GPU check: a round has no host sync (sync debug mode); graph-replayed and compiled rounds give
the same tokens as eager rounds, greedy and sampling (same seed); how long a round takes each way (and how
long compilation takes).

    python eval/device/check_graphs.py            # the default model and its shipped head
    python eval/device/check_graphs.py --tiny     # a small random Llama and head (no model files needed)
    python eval/device/check_graphs.py --tiny --attention flex     # another tree-attention backend
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.decode import run_round  # noqa: E402


def tiny_generator() -> SpeculativeGenerator:
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsd_eagle.head import EagleHead, HeadConfig

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        head = EagleHead(HeadConfig.for_target(cfg)).to(torch.bfloat16).eval()

    class _Tok:
        eos_token_id = None
        chat_template = None

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return ""

    return SpeculativeGenerator(model, _Tok(), head)


tiny = "--tiny" in sys.argv
gen = tiny_generator() if tiny else SpeculativeGenerator.load(device="cuda", dtype="bfloat16")
if "--attention" in sys.argv:
    gen.use_attention(sys.argv[sys.argv.index("--attention") + 1])
prompt = list(range(10, 60)) if tiny else "Explain how a transformer language model generates text, step by step."
kw = dict(chat=False) if tiny else {}
gen.cuda_graphs = False
SAMPLING = dict(temperature=0.7, top_p=0.9, seed=1)
for label, kwargs in (("greedy", {}), ("sampling", SAMPLING)):
    gen.generate(prompt, 32, **kwargs, **kw)
    runner = gen.round_runner(**{k: v for k, v in kwargs.items() if k != "seed"})
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_round(gen.target, gen.drafter, runner.state, gen.tree, runner.form)
        print(f"{label} round without host sync: ok")
    except RuntimeError as e:
        print(f"{label}: host sync inside a round:", e)
    finally:
        torch.cuda.set_sync_debug_mode("default")
for label, kwargs in (("greedy", {}), ("sampling", SAMPLING)):
    for ar in (True, False):
        res = {}
        for backend in ("eager", "graph", "compiled"):
            gen.cuda_graphs, gen.compile = backend != "eager", backend == "compiled"
            t = time.perf_counter()
            gen.generate(prompt, 128, autoregressive=ar, **kwargs, **kw)
            first = time.perf_counter() - t
            torch.cuda.synchronize()
            t = time.perf_counter()
            r = gen.generate(prompt, 128, autoregressive=ar, **kwargs, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            res[backend] = r.token_ids
            print(f"{label} {'AR' if ar else 'EAGLE-2'} {backend} ({r.stats.mode}, {r.stats.attention}): first call "
                  f"{first:.1f} s; {r.stats.new_tokens / dt:.1f} tok/s, tau {r.stats.tau:.2f}, "
                  f"{1000 * dt / r.stats.target_forwards:.2f} ms/round", flush=True)
        print(f"{label}: graph identical to eager:", res["graph"] == res["eager"],
              "| compiled identical to eager:", res["compiled"] == res["eager"])
