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
from eval.speed import random_generator  # noqa: E402
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.decode import run_round  # noqa: E402

SAMPLING = dict(temperature=0.7, top_p=0.9, seed=1)
RULES = (("greedy", {}), ("sampling", SAMPLING))


def tiny_generator(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> SpeculativeGenerator:
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024, max_position_embeddings=4096)
    return random_generator(cfg, dtype, device, seed=0)


def check_no_sync(gen: SpeculativeGenerator, prompt, kw: dict) -> dict[str, bool]:
    """Per rule: whether an eager round of the session a call used runs without a host sync (on the CPU,
    where there is none to detect, only that the round runs)."""
    gen.configure(cuda_graphs=False)
    cuda = gen.target.device.type == "cuda"
    ok = {}
    for label, kwargs in RULES:
        gen.generate(prompt, 32, **kwargs, **kw)
        session = gen.session(**{k: v for k, v in kwargs.items() if k != "seed"})  # the one generate() just used
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            run_round(session.target, session.drafter, session.state, session.tree, session.form)
            print(f"{label} round without host sync: ok")
            ok[label] = True
        except RuntimeError as e:
            print(f"{label}: host sync inside a round:", e)
            ok[label] = False
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    return ok


def compare_backends(gen: SpeculativeGenerator, prompt, kw: dict, max_new_tokens: int = 128) -> dict[str, bool]:
    """Per rule and method: whether graph-replayed and compiled rounds give the eager rounds' tokens."""
    cuda = gen.target.device.type == "cuda"
    same = {}
    for label, kwargs in RULES:
        for ar in (True, False):
            res = {}
            for backend in ("eager", "graph", "compiled"):
                gen.configure(cuda_graphs=backend != "eager", compile=backend == "compiled")
                t = time.perf_counter()
                gen.generate(prompt, max_new_tokens, autoregressive=ar, **kwargs, **kw)
                first = time.perf_counter() - t
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                r = gen.generate(prompt, max_new_tokens, autoregressive=ar, **kwargs, **kw)
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t
                res[backend] = r.token_ids
                print(f"{label} {'AR' if ar else 'EAGLE-2'} {backend} ({r.stats.mode}, {r.stats.attention}): first "
                      f"call {first:.1f} s; {r.stats.new_tokens / dt:.1f} tok/s, tau {r.stats.tau:.2f}, "
                      f"{1000 * dt / r.stats.target_forwards:.2f} ms/round", flush=True)
            print(f"{label}: graph identical to eager:", res["graph"] == res["eager"],
                  "| compiled identical to eager:", res["compiled"] == res["eager"])
            same[f"{label}_{'ar' if ar else 'eagle2'}"] = res["graph"] == res["eager"] == res["compiled"]
    return same


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    tiny = "--tiny" in argv
    gen = tiny_generator() if tiny else SpeculativeGenerator.load(device="cuda", dtype="bfloat16")
    if "--attention" in argv:
        gen.use_attention(argv[argv.index("--attention") + 1])
    prompt = list(range(10, 60)) if tiny else "Explain how a transformer language model generates text, step by step."
    kw = dict(chat=False) if tiny else {}
    check_no_sync(gen, prompt, kw)
    compare_backends(gen, prompt, kw)


if __name__ == "__main__":
    main()
