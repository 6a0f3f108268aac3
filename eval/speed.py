"""GPU speed benchmark (one process, one device): transformers ``generate``, our plain AR, exact EAGLE-2 and
FSD, eager and CUDA-graph replay, on MT-bench first turns, greedy. Also a per-stage breakdown of one round,
peak memory at a 2048-token context, and a random-weight Llama-3-8B-shaped target's per-round cost.

    python -m eval speed --device cuda --dtype bfloat16 --limit 20 --out eval/results/gpu_speed.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_runs(run_one, prompts, repeats: int, device: torch.device) -> tuple[list[float], list]:
    """tokens/s of each repeat over all prompts (synchronized wall clock); ``run_one(p) -> (tokens, result)``.
    Also returns the first repeat's results and resets the peak-memory counter first."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs, first = [], []
    for rep in range(repeats):
        tokens, seconds = 0, 0.0
        for p in prompts:
            _sync(device)
            t = time.perf_counter()
            n, result = run_one(p)
            _sync(device)
            seconds += time.perf_counter() - t
            tokens += n
            if rep == 0:
                first.append(result)
        runs.append(tokens / seconds)
    return runs, first


def _summary(runs: list[float], device: torch.device) -> dict:
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"tokens_per_s": statistics.mean(runs), "tokens_per_s_runs": [round(x, 2) for x in runs], "peak_mem_gb": peak}


def bench_method(gen, prompts, max_new_tokens: int, repeats: int, **kwargs) -> dict:
    """Our decoder: warm-up on the longest prompt (largest cache, graph capture), then timed runs."""
    dev = gen.target.device
    gen.generate(max(prompts, key=len), max_new_tokens, **kwargs)

    def run_one(p):
        r = gen.generate(p, max_new_tokens, **kwargs)
        return r.stats.new_tokens, r

    runs, results = timed_runs(run_one, prompts, repeats, dev)
    tau = sum(r.stats.new_tokens for r in results) / sum(r.stats.target_forwards for r in results)
    return {**_summary(runs, dev), "tau": tau, "outputs": [r.token_ids for r in results]}


def bench_hf(model, tokenizer, prompts, max_new_tokens: int, repeats: int) -> dict:
    """transformers ``generate``, greedy, dynamic cache, same chat-formatted prompts."""
    dev = next(model.parameters()).device
    enc = {p: torch.tensor([tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                          tokenize=True)["input_ids"]], device=dev) for p in prompts}
    kw = dict(do_sample=False, pad_token_id=tokenizer.eos_token_id)
    model.generate(enc[prompts[0]], max_new_tokens=16, **kw)

    def run_one(p):
        out = model.generate(enc[p], max_new_tokens=max_new_tokens, **kw)
        return out.shape[1] - enc[p].shape[1], None

    runs, _ = timed_runs(run_one, prompts, repeats, dev)
    return {**_summary(runs, dev), "tau": 1.0}


def stage_breakdown(gen, prompt: str, rounds: int = 20) -> dict:
    """Mean milliseconds per round of each stage, eager, timed with CUDA events (one sync per stage)."""
    from fsd_eagle.decode import _next_tokens
    from fsd_eagle.sampling import choose
    from fsd_eagle.tree import draft_tree
    from fsd_eagle.verify import AcceptanceRule, verify_tree

    target, drafter, cfg, rule = gen.target, gen.drafter, gen.tree, AcceptanceRule()
    dev = target.device
    ids = torch.tensor(gen.encode(prompt), device=dev)
    max_len = ids.shape[0] + (rounds + 2) * (cfg.depth + 1) + cfg.total_tokens + 8
    target.allocate(max_len)
    drafter.allocate(max_len, cfg)
    f = target.prefill(ids)
    tok = choose(target.logits(f[-1:])[0], rule.sampling, None)
    root = drafter.prefill(torch.cat([ids, tok[None]]), f)
    names = ["draft_tree", "target_forward", "verify", "commit_target", "commit_draft"]
    sums = dict.fromkeys(names, 0.0)
    for _ in range(rounds):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(names) + 1)]
        ev[0].record()
        tree = draft_tree(drafter, tok, root.logits, root.state, cfg)
        ev[1].record()
        feats = target.forward_tree(tree.tokens, tree.depths, tree.anc)
        logits = target.logits(feats)
        ev[2].record()
        verdict = verify_tree(tree, logits, rule)
        ev[3].record()
        target.commit(verdict.path, verdict.n_accepted)
        nxt = _next_tokens(tree, verdict)
        ev[4].record()
        root = drafter.commit(nxt, feats.index_select(0, verdict.path), verdict.n_accepted)
        tok = verdict.bonus
        ev[5].record()
        torch.cuda.synchronize(dev)
        for i, n in enumerate(names):
            sums[n] += ev[i].elapsed_time(ev[i + 1])
    return {n: round(v / rounds, 3) for n, v in sums.items()}


def llama8b_round_cost(dtype: torch.dtype, device: torch.device, tau: float, rounds: int = 30) -> dict:
    """Random-weight Llama-3-8B-shaped target + same-shape random head: ms per round (graph replay) for AR
    and for the default EAGLE-2 tree, and the speedup projected at ``tau`` (measured with the real head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.head import EagleHead, HeadConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
        head = EagleHead(HeadConfig.for_target(cfg)).to(dtype).eval()

    class _Tok:  # token ids only: no tokenizer exists for a random model
        eos_token_id = None
        chat_template = None

        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return ""

    gen = SpeculativeGenerator(model, _Tok(), head)
    prompt = list(range(100, 612))
    out = {}
    for name, ar in (("ar", True), ("eagle2", False)):
        gen.generate(prompt, 8, autoregressive=ar, chat=False)
        _sync(device)
        t = time.perf_counter()
        r = gen.generate(prompt, rounds + 1, autoregressive=ar, chat=False)
        _sync(device)
        out[f"{name}_ms_per_round"] = round(1000 * (time.perf_counter() - t) / r.stats.target_forwards, 3)
    out["projected_speedup_at_tau"] = round(tau * out["ar_ms_per_round"] / out["eagle2_ms_per_round"], 3)
    out["tau_used"] = round(tau, 3)
    del model, head, gen
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    import transformers

    from eval.metrics import token_agreement
    from eval.tasks import load_mt_bench
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import FuzzyConfig, TreeConfig, parse_threshold

    p = argparse.ArgumentParser(prog="python -m eval speed")
    p.add_argument("--target")
    p.add_argument("--head")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threshold", default="1.0")
    p.add_argument("--divergence", default="kl")
    p.add_argument("--total-tokens", type=int, default=60)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--tree-top-k", type=int, default=10)
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--out", default=str(ROOT / "eval" / "results" / "gpu_speed.json"))
    a = p.parse_args(argv)
    tree = TreeConfig(a.total_tokens, a.depth, a.tree_top_k)
    gen = SpeculativeGenerator.load(target=a.target, head=a.head, device=a.device, dtype=a.dtype, tree=tree)
    dev = gen.target.device
    prompts = [q.turns[0] for q in load_mt_bench(limit=a.limit)]
    fuzzy = FuzzyConfig(threshold=parse_threshold(a.threshold), divergence=a.divergence)
    rows = []
    partial = Path(a.out).with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    hf = bench_hf(gen.target.model, gen.tokenizer, prompts, a.max_new_tokens, max(1, a.repeats - 1))
    rows.append({"method": "hf_generate", **hf})
    methods = [("ar_graph", dict(autoregressive=True), True), ("ar_eager", dict(autoregressive=True), False),
               ("eagle2_graph", {}, True), ("eagle2_eager", {}, False),
               (f"fsd_{a.divergence}_T{a.threshold}_graph", dict(fuzzy=fuzzy), True)]
    for name, kwargs, graphs in methods:
        gen.cuda_graphs = graphs
        rows.append({"method": name, **bench_method(gen, prompts, a.max_new_tokens, a.repeats, **kwargs)})
        partial.write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in rows], default=str))
        print(name, round(rows[-1]["tokens_per_s"], 1), "tok/s", flush=True)
    gen.cuda_graphs = True
    ar_out = rows[1]["outputs"]
    base_hf, base_ar = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"]
    for row in rows:
        row["speedup_vs_hf"] = round(row["tokens_per_s"] / base_hf, 3)
        row["speedup_vs_ar_graph"] = round(row["tokens_per_s"] / base_ar, 3)
        outs = row.pop("outputs", None)
        if outs is not None:
            row["agreement_vs_ar"] = round(statistics.mean(token_agreement(x, y) for x, y in zip(outs, ar_out)), 4)
        row["tokens_per_s"] = round(row["tokens_per_s"], 2)
        row["tau"] = round(row["tau"], 3)
        row["device"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    extra = {"stage_ms_per_round_eager": stage_breakdown(gen, prompts[0]) if dev.type == "cuda" else None}
    # Peak memory at a 2048-token context: AR vs EAGLE-2 (graphs), prompt of 1900 tokens + 128 new.
    long_prompt = list(range(1000, 2900))
    mem = {}
    for name, ar in (("ar", True), ("eagle2", False)) if dev.type == "cuda" else ():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        gen.generate(long_prompt, 128, autoregressive=ar, chat=False)
        mem[name] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
    extra["peak_mem_gb_2048_context"] = mem
    if not a.skip_8b and dev.type == "cuda":
        extra["llama3_8b_shape"] = llama8b_round_cost(gen.target.dtype, dev, rows[3]["tau"])
    result = {"rows": rows, **extra,
              "meta": {"date": date.today().isoformat(), "device": rows[0]["device"], "torch": torch.__version__,
                       "transformers": transformers.__version__, "dtype": a.dtype, "prompts": len(prompts),
                       "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "tree": vars(tree) if hasattr(tree, "__dict__") else str(tree),
                       "command": "python -m eval speed " + " ".join(argv if argv is not None else sys.argv[1:])}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    for row in rows:
        print(f"{row['method']:28s} {row['tokens_per_s']:9.1f} tok/s  x{row['speedup_vs_hf']:.2f} vs HF  "
              f"x{row['speedup_vs_ar_graph']:.2f} vs AR  tau {row['tau']:.2f}  mem {row['peak_mem_gb']}  agree {row.get('agreement_vs_ar')}")
    print(json.dumps(extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
