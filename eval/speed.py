"""GPU speed benchmark (one process, one device): transformers ``generate``, our plain AR, exact EAGLE-2 and
FSD, eager and CUDA-graph replay, on MT-bench first turns, greedy. Also a per-stage breakdown of one round,
peak memory at a 2048-token context, and a random-weight Llama-3-8B-shaped target's per-round cost.

    python -m eval speed --device cuda --dtype bfloat16 --limit 20 --compile --out eval/results/gpu_speed.json
    python -m eval speed --methods ar,eagle2 --backends compiled --rows-only ...   # a shorter run
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
    """Our decoder: warm-up on the longest prompt (largest cache, graph capture, compilation; its time is
    ``warmup_s``) and a short call per prompt (prefill graphs of every length bucket), then timed runs."""
    dev = gen.target.device
    t = time.perf_counter()
    gen.generate(max(prompts, key=len), max_new_tokens, **kwargs)
    warmup_s = time.perf_counter() - t
    for p in prompts:  # capture every prompt-length bucket's prefill graph before timing
        gen.generate(p, 2, **kwargs)

    def run_one(p):
        r = gen.generate(p, max_new_tokens, **kwargs)
        return r.stats.new_tokens, r

    runs, results = timed_runs(run_one, prompts, repeats, dev)
    tau = sum(r.stats.new_tokens for r in results) / sum(r.stats.target_forwards for r in results)
    # time to the first token: the prefill (and, with graphs, the first round launched behind it)
    ttft_ms = 1000 * statistics.mean(r.stats.prefill_s for r in results)
    return {**_summary(runs, dev), "tau": tau, "warmup_s": round(warmup_s, 2), "ttft_ms": round(ttft_ms, 2),
            "outputs": [r.token_ids for r in results]}


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


def stage_breakdown(gen, prompt: str, rounds: int = 30, compile: bool = False) -> dict:
    """Mean milliseconds per round of each stage: draft tree, target forward (with the lm_head), verification,
    commits (both KV caches and the drafter's root step). Each stage is captured as its own CUDA graph (after
    torch.compile if ``compile``), the four replayed in turn as a round, timed with CUDA events."""
    from fsd_eagle.decode import RoundState, commit_round
    from fsd_eagle.sampling import choose
    from fsd_eagle.tree import draft_tree
    from fsd_eagle.verify import AcceptanceRule, verify_tree

    target, drafter, cfg, rule = gen.target, gen.drafter, gen.tree, AcceptanceRule()
    target.use_attention(gen.resolve_attention())
    dev = target.device
    ids = torch.tensor(gen.encode(prompt), device=dev)
    max_len = ids.shape[0] + (rounds + 8) * (cfg.depth + 1) + cfg.total_tokens + 8
    target.allocate(max_len)
    drafter.allocate(max_len, cfg)
    f = target.prefill(ids)
    tok = choose(target.logits(f[-1:])[0], rule.sampling, None)
    root = drafter.prefill(torch.cat([ids, tok[None]]), f)
    st = RoundState(tok.clone(), root.logits.clone(), root.state.clone())
    box: dict = {}

    def draft():
        box["tree"] = draft_tree(drafter, st.root_token, st.root_logits, st.root_state, cfg)

    def forward():
        tree = box["tree"]
        box["f"] = target.forward_tree(tree.tokens, tree.depths, tree.anc)
        box["logits"] = target.logits(box["f"])

    def verify():
        box["v"] = verify_tree(box["tree"], box["logits"], rule)

    def commit():
        commit_round(target, drafter, st, box["tree"], box["f"], box["v"])

    stages = {"draft_tree": draft, "target_forward": forward, "verify": verify, "commit": commit}
    if compile:
        stages = {k: torch.compile(fn, dynamic=False) for k, fn in stages.items()}
    state = [target.length, drafter.length, st.root_token, st.root_logits, st.root_state]
    saved = [t.clone() for t in state]
    for _ in range(2):  # warm-up (and compilation), then back to the start
        for fn in stages.values():
            fn()
        for t, v in zip(state, saved):
            t.copy_(v)
    torch.cuda.synchronize(dev)
    graphs = {}
    for name, fn in stages.items():
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            fn()
    sums = dict.fromkeys(stages, 0.0)
    for _ in range(rounds):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
        ev[0].record()
        for i, g in enumerate(graphs.values()):
            g.replay()
            ev[i + 1].record()
        torch.cuda.synchronize(dev)
        for i, n in enumerate(stages):
            sums[n] += ev[i].elapsed_time(ev[i + 1])
    out = {n: round(v / rounds, 3) for n, v in sums.items()}
    out["round"] = round(sum(out.values()), 3)
    return out


def llama8b_round_cost(dtype: torch.dtype, device: torch.device, tau: float, compile: bool = False,
                       rounds: int = 30) -> dict:
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
    gen.compile = compile
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


def annotate(rows: list[dict], outputs: dict, device_name: str) -> list[dict]:
    """Copies of the method rows with their speedup vs transformers ``generate`` and vs our AR of the same
    backend (same kernels; HF's row against the graph AR), token agreement with those ARs' outputs, rounded."""
    from eval.metrics import token_agreement

    ar_rows = {r["backend"]: r for r in rows if r["method"].startswith("ar_")}
    base_hf = next((r["tokens_per_s"] for r in rows if r["method"] == "hf_generate"), None)

    def agreement(method: str, ar_row: dict) -> float:
        pairs = zip(outputs[method], outputs[ar_row["method"]])
        return round(statistics.mean(token_agreement(x, y) for x, y in pairs), 4)

    done = []
    for row in rows:
        row = dict(row)
        row["speedup_vs_hf"] = round(row["tokens_per_s"] / base_hf, 3) if base_hf else None
        same = ar_rows.get(row["backend"], ar_rows.get("graph"))
        row["speedup_vs_ar"] = round(row["tokens_per_s"] / same["tokens_per_s"], 3) if same else None
        if outputs.get(row["method"]) is not None and same:
            row["agreement_vs_ar"] = agreement(row["method"], same)
            if "graph" in ar_rows:
                row["agreement_vs_ar_graph"] = agreement(row["method"], ar_rows["graph"])
        row["tokens_per_s"] = round(row["tokens_per_s"], 2)
        row["tau"] = round(row["tau"], 3)
        row["device"] = device_name
        done.append(row)
    return done


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    import transformers

    from eval.tasks import load_mt_bench
    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import FuzzyConfig, parse_threshold

    p = argparse.ArgumentParser(prog="python -m eval speed")
    p.add_argument("--target")
    p.add_argument("--head")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: SpeculativeGenerator.load's)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--hf-limit", type=int,
                   help="measure transformers generate on the first N prompts only (default: all; it is ~50x slower)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threshold", default="1.0")
    p.add_argument("--divergence", default="kl")
    p.add_argument("--total-tokens", type=int, help="tree size (default: the device's preset, trees/presets.json)")
    p.add_argument("--depth", type=int)
    p.add_argument("--tree-top-k", type=int)
    p.add_argument("--draft-vocab", type=int, help="draft vocabulary size (0 = all tokens; default: the preset's)")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--compile", action="store_true", help="also measure rounds compiled with torch.compile")
    p.add_argument("--eager", action="store_true", help="also measure eager rounds (no CUDA graphs)")
    p.add_argument("--backends", help="comma-separated subset of eager,graph,compiled (default: graph plus the "
                                      "ones --eager / --compile add)")
    p.add_argument("--methods", default="hf,ar,eagle2,fsd", help="comma-separated subset of hf,ar,eagle2,fsd")
    p.add_argument("--memory-compiled", action="store_true",
                   help="measure peak memory with compiled rounds (their 2048-token context needs a larger cache: "
                        "recompiles, ~3 minutes on an H100); default: CUDA graphs without compilation")
    p.add_argument("--rows-only", action="store_true",
                   help="only the method rows: no stage breakdown, peak memory or 8B-shape round cost")
    p.add_argument("--out", default=str(ROOT / "eval" / "results" / "gpu_speed.json"))
    a = p.parse_args(argv)
    gen = SpeculativeGenerator.load(target=a.target, head=a.head, device=a.device, dtype=a.dtype, threads=a.threads)
    tree = gen.set_tree(a.total_tokens, a.depth, a.tree_top_k, a.draft_vocab)
    dev = gen.target.device
    prompts = [q.turns[0] for q in load_mt_bench(limit=a.limit)]
    fuzzy = FuzzyConfig(threshold=parse_threshold(a.threshold), divergence=a.divergence)
    rows, outputs = [], {}
    partial = Path(a.out).with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    methods = a.methods.split(",")
    if "hf" in methods:
        hf_prompts = prompts[: a.hf_limit] if a.hf_limit else prompts
        hf = bench_hf(gen.target.model, gen.tokenizer, hf_prompts, a.max_new_tokens, max(1, a.repeats - 1))
        outputs["hf_generate"] = hf.pop("outputs", None)  # agreement: over these prompts only
        rows.append({"method": "hf_generate", "backend": "hf", "prompts": len(hf_prompts), **hf})
    backends = (a.backends.split(",") if a.backends else
                (["eager"] if a.eager else []) + ["graph"] + (["compiled"] if a.compile else []))
    compiled = "compiled" in backends
    fsd_name = f"fsd_{a.divergence}_T{a.threshold}"
    ours = [(name, kwargs) for key, name, kwargs in (("ar", "ar", dict(autoregressive=True)), ("eagle2", "eagle2", {}),
                                                      ("fsd", fsd_name, dict(fuzzy=fuzzy))) if key in methods]
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    for backend in backends:
        gen.cuda_graphs, gen.compile = backend != "eager", backend == "compiled"
        for name, kwargs in ours:
            row = bench_method(gen, prompts, a.max_new_tokens, a.repeats, **kwargs)
            outputs[f"{name}_{backend}"] = row.pop("outputs", None)
            rows.append({"method": f"{name}_{backend}", "backend": backend, "attention": gen.resolve_attention(),
                         "prompts": len(prompts), **row})
            # Every row so far, complete (speedups, agreement): a run cut short keeps what it measured.
            partial.write_text(json.dumps(annotate(rows, outputs, device_name), default=str))
            print(rows[-1]["method"], round(rows[-1]["tokens_per_s"], 1), "tok/s", flush=True)
    rows = annotate(rows, outputs, device_name)
    extra = {}
    if dev.type == "cuda" and not a.rows_only:
        for backend in backends[-2:] if compiled else ["graph"]:
            gen.cuda_graphs, gen.compile = True, backend == "compiled"
            extra[f"stage_ms_per_round_{backend}"] = stage_breakdown(gen, prompts[0], compile=gen.compile)
            print(backend, extra[f"stage_ms_per_round_{backend}"], flush=True)
    gen.cuda_graphs, gen.compile = True, compiled and a.memory_compiled
    # Peak memory at a 2048-token context: AR vs EAGLE-2 (graphs), prompt of 1900 tokens + 128 new.
    long_prompt = list(range(1000, 2900))
    mem = {}
    for name, ar in (("ar", True), ("eagle2", False)) if dev.type == "cuda" and not a.rows_only else ():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        gen.generate(long_prompt, 128, autoregressive=ar, chat=False)
        mem[name] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
    if mem:
        extra["peak_mem_gb_2048_context"] = {**mem, "backend": "compiled" if gen.compile else "graph"}
    tau = next((r["tau"] for r in rows if r["method"] == f"eagle2_{backends[-1]}"), None)
    if not a.skip_8b and not a.rows_only and dev.type == "cuda" and tau is not None:
        extra["llama3_8b_shape"] = llama8b_round_cost(gen.target.dtype, dev, tau, compiled)
    result = {"rows": rows, **extra,
              "meta": {"date": date.today().isoformat(), "device": rows[0]["device"], "torch": torch.__version__,
                       "transformers": transformers.__version__, "dtype": str(gen.target.dtype).replace("torch.", ""),
                       "threads": torch.get_num_threads(), "prompts": len(prompts),
                       "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "tree": tree.to_dict(),
                       "command": "python -m eval speed " + " ".join(argv if argv is not None else sys.argv[1:])}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    for row in rows:
        print(f"{row['method']:28s} {row['tokens_per_s']:9.1f} tok/s  x{row['speedup_vs_hf']} vs HF  "
              f"x{row['speedup_vs_ar']} vs AR  tau {row['tau']:.2f}  mem {row['peak_mem_gb']}  agree {row.get('agreement_vs_ar')}")
    if extra:
        print(json.dumps(extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
