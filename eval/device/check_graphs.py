"""Quick GPU check: a round has no host sync (sync debug mode); graph-replayed and compiled rounds give
the same tokens as eager rounds, greedy and sampling (same seed); how long a round takes each way (and how
long compilation takes).

    python eval/device/check_graphs.py            # the default model and its shipped head
    python eval/device/check_graphs.py --head DIR # the default model with another head (e.g. an EAGLE-3 one)
    python eval/device/check_graphs.py --tiny     # a small random Llama and head (no model files needed)
    python eval/device/check_graphs.py --tiny --attention flex     # another tree-attention backend
    python eval/device/check_graphs.py --target "$(python -m fsd_eagle.gemma3)" --random-head \
        --dtype float32 --long    # Gemma 3 270M, a prompt past its 512-token sliding window
"""

import argparse
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


def check_no_sync(gen: SpeculativeGenerator, prompt, kw: dict, rules=RULES) -> dict[str, bool]:
    """Per rule: whether an eager round of the session a call used runs without a host sync (on the CPU,
    where there is none to detect, only that the round runs)."""
    gen.configure(cuda_graphs=False)
    cuda = gen.target.device.type == "cuda"
    ok = {}
    for label, kwargs in rules:
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


def compare_backends(gen: SpeculativeGenerator, prompt, kw: dict, max_new_tokens: int = 128,
                     rules=RULES) -> dict[str, bool]:
    """Per rule and method: whether graph-replayed and compiled rounds give the eager rounds' tokens; and
    for greedy decoding (exact in float32), whether EAGLE-2 gives AR's tokens (key ``greedy_eagle2_is_ar``)."""
    cuda = gen.target.device.type == "cuda"
    same, eager = {}, {}
    for label, kwargs in rules:
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
            eager[label, ar] = res["eager"]
        if label == "greedy":
            same["greedy_eagle2_is_ar"] = eager[label, True] == eager[label, False]
            print(f"greedy: EAGLE-2 identical to AR ({gen.target.model.dtype}):", same["greedy_eagle2_is_ar"],
                  flush=True)
    return same


def long_prompt(gen: SpeculativeGenerator) -> list[int]:
    """Token ids of the first 14 MT-bench first turns joined (about 700 tokens with SmolLM2's or Gemma 3's
    tokenizer: past a 512-token sliding window)."""
    from eval.tasks import load_mt_bench

    return gen.encode(" ".join(q.turns[0] for q in load_mt_bench(limit=14)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a small random Llama and head")
    ap.add_argument("--target", help="target folder (default: the default model)")
    ap.add_argument("--head", help="draft head folder (default: the target's shipped head)")
    ap.add_argument("--random-head", action="store_true", help="a random head of the target's shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attention", help="tree-attention backend")
    ap.add_argument("--long", action="store_true", help="a prompt of ~700 tokens (past a 512-token window)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--greedy-only", action="store_true", help="no sampling rule (half the compilations)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        gen = tiny_generator(dtype=getattr(torch, args.dtype))
    else:
        gen = SpeculativeGenerator.load(target=args.target, head=args.head, device="cuda", dtype=args.dtype,
                                        random_head=args.random_head)
    if args.attention:
        gen.use_attention(args.attention)
    if args.tiny:
        prompt, kw = list(range(10, 60)), dict(chat=False)
    elif args.long:
        prompt, kw = long_prompt(gen), {}
        print(f"prompt of {len(prompt)} tokens", flush=True)
    else:
        prompt, kw = "Explain how a transformer language model generates text, step by step.", {}
    rules = RULES[:1] if args.greedy_only else RULES
    check_no_sync(gen, prompt, kw, rules)
    compare_backends(gen, prompt, kw, args.new_tokens, rules)


if __name__ == "__main__":
    main()
