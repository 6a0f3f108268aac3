"""GPU speed benchmark (one process, one device): transformers ``generate``, our plain AR, exact EAGLE-2 and
FSD, eager, CUDA-graph replay and compiled rounds, on MT-bench first turns (``--prompts``: or the first GSM8K
test problems, or the generated arithmetic test problems, in the sweep's prompt format), greedy and at the temperatures
of ``--temperatures``. Also a per-stage breakdown of one round, peak memory at a 2048-token context, and a
random-weight Llama-3-8B-shaped target's per-round cost.

    python -m eval speed --device cuda --dtype bfloat16 --limit 80 --compile --out runs/gpu_speed.json
    python -m eval speed --methods ar,eagle2 --backends compiled --rows-only ...   # a shorter run
    python -m eval speed --methods ar,eagle2,fsd --fsd kl:1,reverse_kl:1 --temperatures 0,0.7,1.0 \
        --compile --rows-only --out runs/gpu_sampling.json                # sampling vs greedy

Rows: ``method`` (hf_generate, ar, eagle2, fsd), ``divergence`` / ``threshold`` (FSD), ``backend`` (hf, eager,
graph, compiled), ``temperature`` / ``top_p``, ``tokens_per_s``, ``tau``, ``prompts``, ``device``, ``mode`` and
``attention`` (how the rounds really ran), ``ms_per_round`` (a call's time over its target forwards, prefill
included), and ``name``, a unique label. ``--tp N`` under ``torchrun --nproc-per-node N`` shards the target
over N GPUs (our rows only; rank 0 writes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

from fsd_eagle.jsonl import write_text_atomic

from .rows import _label, parse_trees, row_patterns, row_wanted, sampling_rows  # noqa: F401
from .runinfo import git_commit

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    """What a CPU row ran on: architecture and the cores this process may use."""
    return f"CPU ({platform.machine()}, {len(os.sched_getaffinity(0))} cores)"


def device_label(device: torch.device) -> str:
    """A result row's ``device``: the GPU's name, or the CPU's (``cpu_name``)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (GPU), so that wall-clock times cover it."""
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
            sync(device)
            t = time.perf_counter()
            n, result = run_one(p)
            sync(device)
            seconds += time.perf_counter() - t
            tokens += n
            if rep == 0:
                first.append(result)
        runs.append(tokens / seconds)
    return runs, first


def add_tree_arguments(p) -> None:
    """The tree options of a benchmark (default: the device's preset, fsd_eagle/presets.json)."""
    p.add_argument("--total-tokens", type=int, help="tree size (default: the device's preset, fsd_eagle/presets.json)")
    p.add_argument("--depth", type=int)
    p.add_argument("--tree-top-k", type=int)
    p.add_argument("--draft-vocab", type=int, help="draft vocabulary size (0 = all tokens; default: the preset's)")
    p.add_argument("--pool", type=int, help="sampled children drawn from each node's POOL most likely draft tokens "
                                            "(0 = the whole draft vocabulary; default: the preset's)")


def _summary(runs: list[float], device: torch.device) -> dict:
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"tokens_per_s": statistics.mean(runs), "tokens_per_s_runs": [round(x, 2) for x in runs], "peak_mem_gb": peak}


def bench_method(gen, prompts, max_new_tokens: int, repeats: int, seeds: dict | None = None, **kwargs) -> dict:
    """Our decoder: warm-up on the longest prompt (largest cache, graph capture, compilation; its time is
    ``warmup_s``) and a short call per prompt (prefill graphs of every length bucket), then timed runs.
    ``seeds``: a seed per prompt (sampling), so that every repeat decodes the same texts."""
    dev = gen.target.device
    seeds = seeds or {}
    t = time.perf_counter()
    gen.generate(max(prompts, key=len), max_new_tokens, **kwargs)
    warmup_s = time.perf_counter() - t
    for p in prompts:  # capture every prompt-length bucket's prefill graph before timing
        gen.generate(p, 2, seed=seeds.get(p), **kwargs)

    def run_one(p):
        r = gen.generate(p, max_new_tokens, seed=seeds.get(p), **kwargs)
        return r.stats.new_tokens, r

    runs, results = timed_runs(run_one, prompts, repeats, dev)
    forwards = sum(r.stats.target_forwards for r in results)
    tau = sum(r.stats.new_tokens for r in results) / forwards
    # time to the first token: the prefill (and, with graphs, the first round launched behind it)
    ttft_ms = 1000 * statistics.mean(r.stats.prefill_s for r in results)
    ms_per_round = 1000 * sum(r.stats.elapsed_s for r in results) / forwards  # prefills included
    return {**_summary(runs, dev), "tau": tau, "warmup_s": round(warmup_s, 2), "ttft_ms": round(ttft_ms, 2),
            "ms_per_round": round(ms_per_round, 3),
            "mode": results[-1].stats.mode, "attention": results[-1].stats.attention,
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
    commits (both KV caches and the drafter's root step). Runs on the one-row session a greedy call uses
    (its caches, round state and tree attention), tensors ``[1, ...]``, from the prompt's prefill. Each stage
    is captured as its own CUDA graph (after torch.compile if ``compile``), the four replayed in turn as a
    round, timed with CUDA events."""
    from fsd_eagle.decode import commit_round, plan_cache
    from fsd_eagle.tree import draft_tree
    from fsd_eagle.verify import AcceptanceRule, verify_tree

    session, rule = gen.session(), AcceptanceRule()
    target, drafter, st, cfg, form = session.target, session.drafter, session.state, session.tree, session.form
    target.use_attention(session.attention)
    dev = target.device
    ids = torch.tensor(gen.encode(prompt), device=dev)
    session.allocate(plan_cache(session.prompt_slots(ids.shape[0]), (rounds + 8) * (cfg.depth + 1), cfg))
    session.start(0, ids, rule, 0).read()
    box: dict = {}

    def draft():
        box["tree"] = draft_tree(drafter, st.root_token, st.root_logits, st.root_state, cfg)

    def forward():
        tree = box["tree"]
        box["f"] = target.forward_tree(tree.tokens, tree.depths, tree.anc)
        box["logits"] = target.logits(box["f"])

    def verify():
        box["v"] = verify_tree(box["tree"], box["logits"], form, st.values, st.rng)

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


class IdsOnly:
    """The tokenizer of a random-weight model: token ids in, no text out (no real tokenizer exists)."""

    eos_token_id = None
    chat_template = None

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return ""


def random_generator(config, dtype: torch.dtype, device: torch.device | str, seed: int | None = None):
    """A SpeculativeGenerator over a random-weight LlamaForCausalLM of ``config`` and a same-shape random
    EAGLE head (``seed``: torch's seed before the weights are drawn); prompts are token ids (``chat=False``)."""
    from transformers import LlamaForCausalLM

    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.head import EagleHead, HeadConfig

    if seed is not None:
        torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
        head = EagleHead(HeadConfig.for_target(config)).to(dtype).eval()
    return SpeculativeGenerator(model, IdsOnly(), head)


def llama8b_round_cost(dtype: torch.dtype, device: torch.device, tau: float, compile: bool = False,
                       rounds: int = 30) -> dict:
    """Random-weight Llama-3-8B-shaped target + same-shape random head: ms per round (graph replay) for AR
    and for the default EAGLE-2 tree, and the speedup projected at ``tau`` (measured with the real head)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    gen = random_generator(cfg, dtype, device)
    gen.configure(compile=compile)
    prompt = list(range(100, 612))
    out = {}
    for name, ar in (("ar", True), ("eagle2", False)):
        gen.generate(prompt, 8, autoregressive=ar, chat=False)
        sync(device)
        t = time.perf_counter()
        r = gen.generate(prompt, rounds + 1, autoregressive=ar, chat=False)
        sync(device)
        out[f"{name}_ms_per_round"] = round(1000 * (time.perf_counter() - t) / r.stats.target_forwards, 3)
    out["projected_speedup_at_tau"] = round(tau * out["ar_ms_per_round"] / out["eagle2_ms_per_round"], 3)
    out["tau_used"] = round(tau, 3)
    del gen
    torch.cuda.empty_cache()
    return out


def annotate(rows: list[dict], outputs: dict, device_name: str) -> list[dict]:
    """Copies of the method rows, rounded, with: speedup vs transformers ``generate`` and vs our AR with the
    same backend and sampling settings (same kernels; HF's row against the graph AR); for sampling rows, the
    ratio to the same method's greedy row (``vs_greedy``: of the same head and tree, or else of the only
    greedy row of that method, rule, backend and head, as when a preset samples with a tree of its own;
    ``greedy_tree`` then names that row's tree); for greedy rows, token agreement with those ARs' outputs
    (sampled texts differ by design, so they get none)."""
    from eval.metrics import token_agreement

    def settings(r: dict) -> tuple:
        return r["backend"], r.get("temperature", 0.0), r.get("top_p", 1.0)

    ar_rows = {settings(r): r for r in rows if r["method"] == "ar"}
    base_hf = next((r["tokens_per_s"] for r in rows if r["method"] == "hf_generate"), None)
    greedy = {(r["method"], r.get("divergence"), r.get("threshold"), r["backend"], r.get("head"), r.get("tree")): r
              for r in rows if not r.get("temperature")}

    def agreement(row: dict, ar_row: dict) -> float:
        pairs = zip(outputs[row["name"]], outputs[ar_row["name"]])
        return round(statistics.mean(token_agreement(x, y) for x, y in pairs), 4)

    done = []
    for row in rows:
        row = dict(row)
        row["speedup_vs_hf"] = round(row["tokens_per_s"] / base_hf, 3) if base_hf else None
        same = ar_rows.get(settings(row), ar_rows.get(("graph", 0.0, 1.0)))
        row["speedup_vs_ar"] = round(row["tokens_per_s"] / same["tokens_per_s"], 3) if same else None
        if row.get("temperature"):
            rule = (row["method"], row.get("divergence"), row.get("threshold"), row["backend"], row.get("head"))
            base = greedy.get(rule + (row.get("tree"),))
            if base is None:
                of_rule = [r for key, r in greedy.items() if key[:5] == rule]
                base = of_rule[0] if len(of_rule) == 1 else None
                if base is not None:
                    row["greedy_tree"] = base.get("tree")
            row["vs_greedy"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
        elif outputs.get(row["name"]) is not None and same:
            row["agreement_vs_ar"] = agreement(row, same)
            graph_ar = ar_rows.get(("graph", 0.0, 1.0))
            if graph_ar:
                row["agreement_vs_ar_graph"] = agreement(row, graph_ar)
        row["tokens_per_s"] = round(row["tokens_per_s"], 2)
        row["tau"] = round(row["tau"], 3)
        row["device"] = device_name
        done.append(row)
    return done


def parse_floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {what} must be comma-separated numbers, got {text!r}") from None


def parse_fsd(text: str) -> list[tuple[str, float]]:
    """"kl:1,reverse_kl:1" -> [("kl", 1.0), ("reverse_kl", 1.0)]."""
    from fsd_eagle.config import parse_threshold

    out = []
    for item in text.split(","):
        div, _, t = item.strip().partition(":")
        if not div or not t:
            raise SystemExit(f"error: --fsd takes divergence:threshold pairs (e.g. kl:1,reverse_kl:1), got {item!r}")
        out.append((div, parse_threshold(t)))
    return out


def compare_names(heads: list[str]) -> dict[str, str]:
    """Each compared head's suffix in row names: its folder's name, with its place (1, 2, ...) added where
    two heads share a folder name."""
    names = [Path(h).name or str(h) for h in heads]
    return {h: n if names.count(n) == 1 else f"{n}{i + 1}" for i, (h, n) in enumerate(zip(heads, names))}


def load_prompts(source: str, limit: int) -> list[str]:
    """The first ``limit`` prompts of ``source``: MT-bench first turns, or GSM8K / arithmetic test problems
    as the sweep's user messages (eval/tasks.py)."""
    from eval.tasks import arith_prompt, gsm8k_prompt, load_arith, load_gsm8k, load_mt_bench

    if source == "gsm8k":
        return [gsm8k_prompt(p) for p in load_gsm8k("test", limit=limit)]
    if source == "arith":
        return [arith_prompt(p) for p in load_arith("test", limit=limit)]
    return [q.turns[0] for q in load_mt_bench(limit=limit)]


def warm_first(a, backends: list[str], temperatures: list[float], children: list[str],
               fsd_rows: list[tuple[str, float]]) -> None:
    """``--warm``: compile the run's compiled configurations side by side first (eval/warm.py); their rows
    and logs go beside ``--out``, under ``<out stem>.warm/``."""
    from eval.warm import warm, warmups

    if "compiled" not in backends or a.tp > 1:
        print("warm-up: nothing to compile here (no compiled backend, or a tensor-parallel run)", flush=True)
        return
    jobs = warmups(a, a.methods.split(","), fsd_rows, temperatures, children)
    out = Path(a.out).with_suffix(".warm") if a.out != os.devnull else Path(tempfile.mkdtemp(prefix="fsd-warm-"))
    started = time.perf_counter()
    status = warm(jobs, a.warm or 4, out)
    failed = sorted(name for name, rc in status.items() if rc)
    print(f"warm-up: {len(jobs) - len(failed)} of {len(jobs)} configurations compiled in "
          f"{time.perf_counter() - started:.0f} s" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(ROOT))
    import transformers

    from fsd_eagle.api import SpeculativeGenerator
    from fsd_eagle.config import FuzzyConfig

    p = argparse.ArgumentParser(prog="python -m eval speed")
    p.add_argument("--target")
    p.add_argument("--head")
    p.add_argument("--draft-model", help="a small causal LM folder drafting instead of a head (classic SD)")
    p.add_argument("--compare-head", action="append", default=[], metavar="HEAD",
                   help="also measure the drafting rows with this head (repeatable), after the rest of the run and "
                        "against its plain-decoding rows: rows named ...@<its folder's name>, recording the head")
    p.add_argument("--prompts", choices=("mt_bench", "gsm8k", "arith"), default="mt_bench",
                   help="MT-bench first turns (default), or GSM8K / arithmetic test problems as the sweep asks them")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: SpeculativeGenerator.load's)")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--hf-limit", type=int,
                   help="measure transformers generate on the first N prompts only (default: all; it is ~50x slower)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threshold", default="1.0", help="FSD threshold (with --divergence; see --fsd for several)")
    p.add_argument("--divergence", default="kl")
    p.add_argument("--fsd", help="FSD rows as divergence:threshold pairs, e.g. kl:1,reverse_kl:1 (default: "
                                 "--divergence:--threshold)")
    p.add_argument("--temperatures", default="0",
                   help="comma-separated temperatures, 0 = greedy (e.g. 0,0.7,1.0); each method and backend is "
                        "measured at each, in this order")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of the sampling rows (temperature > 0)")
    p.add_argument("--children", default="top",
                   help="comma-separated: the drafting rows at temperature > 0 (eagle2 and fsd) with the tree's "
                        "top children and/or children sampled from the drafter (top,sampled); rows of 'sampled' "
                        "are named ..._sampled")
    p.add_argument("--seed", type=int, default=0, help="sampling rows: prompt i is decoded with seed + i")
    p.add_argument("--rows", default="",
                   help="comma-separated glob patterns of row names, e.g. 'ar_*,eagle2_*,fsd_*_sampled': only the "
                        "rows (and warm-ups) whose name matches one are measured (default: every row)")
    add_tree_arguments(p)
    p.add_argument("--trees", help="drafting rows with each of these trees (total/depth/top_k[/v<draft_vocab>], "
                                   "comma-separated; each row records its tree), instead of the one tree above")
    p.add_argument("--inductor-freezing", action="store_true",
                   help="compile with inductor's freezing (as FSD_EAGLE_INDUCTOR_FREEZING=1: fused q/k/v and "
                        "gate/up matmuls)")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--tp", type=int, default=1,
                   help="shard the target over N GPUs (launch with torchrun --nproc-per-node N; rank 0 writes); "
                        "no HF generate row, stage breakdown, peak memory or 8B-shape rows then "
                        "(eval/device/tp_check.py measures tensor-parallel shapes)")
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
    p.add_argument("--code", help="commit to record (default: git rev-parse HEAD; for a copy whose .git is stale)")
    p.add_argument("--warm", type=int, default=0, metavar="N",
                   help="first compile each compiled row's configuration in a short process of its own, N at a "
                        "time (eval/warm.py), so that this run finds them in the machine's inductor cache")
    p.add_argument("--warm-only", action="store_true", help="only the warm-up processes (--warm, default 4)")
    a = p.parse_args(argv)
    temperatures = parse_floats(a.temperatures, "--temperatures")
    children_kinds = [c.strip() for c in a.children.split(",") if c.strip()]
    if not children_kinds or any(c not in ("top", "sampled") for c in children_kinds):
        raise SystemExit(f"error: --children takes top and/or sampled, comma-separated; got {a.children!r}")
    trees = parse_trees(a.trees)
    if a.compare_head and a.tp > 1:
        raise SystemExit("error: --compare-head measures on one GPU: leave out --tp")
    head_names = compare_names(a.compare_head)
    if a.inductor_freezing:
        from fsd_eagle.decode import FREEZING_ENV

        os.environ[FREEZING_ENV] = "1"
    fsd_rows = parse_fsd(a.fsd or f"{a.divergence}:{a.threshold}")
    backends = (a.backends.split(",") if a.backends else
                (["eager"] if a.eager else []) + ["graph"] + (["compiled"] if a.compile else []))
    if a.warm > 0 or a.warm_only:
        warm_first(a, backends, temperatures, children_kinds, fsd_rows)
        if a.warm_only:
            return 0
    gen = SpeculativeGenerator.load(target=a.target, head=a.head, draft_model=a.draft_model, device=a.device,
                                    dtype=a.dtype, threads=a.threads, tp_size=a.tp)
    from fsd_eagle.decode import freezing
    from fsd_eagle.parallel import is_main_rank

    if a.tp > 1:  # the rounds alone: every rank runs them, rank 0 reports
        a.rows_only = True
        a.methods = ",".join(m for m in a.methods.split(",") if m != "hf")
    if not is_main_rank():
        a.out = os.devnull
        sys.stdout = open(os.devnull, "w")
    tree = gen.set_tree(a.total_tokens, a.depth, a.tree_top_k, a.draft_vocab, a.pool)
    dev = gen.target.device
    prompts = load_prompts(a.prompts, a.limit)
    rows, outputs = [], {}
    partial = Path(a.out).with_suffix(".partial.json") if a.out != os.devnull else Path(os.devnull)
    partial.parent.mkdir(parents=True, exist_ok=True)
    methods = a.methods.split(",")
    if "hf" in methods:
        hf_prompts = prompts[: a.hf_limit] if a.hf_limit else prompts
        hf = bench_hf(gen.target.model, gen.tokenizer, hf_prompts, a.max_new_tokens, max(1, a.repeats - 1))
        row = {"method": "hf_generate", "backend": "hf", "temperature": 0.0, "top_p": 1.0,
               "prompts": len(hf_prompts), **hf}
        row["name"] = _label(row)
        outputs[row["name"]] = hf.pop("outputs", None)  # agreement: over these prompts only
        rows.append(row)
    compiled = "compiled" in backends
    ours = ([("ar", None, None, dict(autoregressive=True))] if "ar" in methods else []) + \
        ([("eagle2", None, 0.0, {})] if "eagle2" in methods else []) + \
        ([("fsd", d, t, dict(fuzzy=FuzzyConfig(threshold=t, divergence=d))) for d, t in fsd_rows] if "fsd" in methods else [])
    device_name = device_label(dev)
    # Plain decoding does not depend on the tree: its rows come once, the drafting rows once per tree.
    tree_runs = [(t, [m for m in ours if m[0] != "ar" or t is trees[0]]) for t in trees] or [(None, ours)]

    def measure(gen, tree_runs, head: str | None = None) -> None:
        """Every wanted row of ``tree_runs`` with ``gen``, appended to ``rows`` (a compared ``head``: named
        ``...@head``, recording it); the partial file rewritten after each."""
        for backend in backends:
            gen.configure(cuda_graphs=backend != "eager", compile=backend == "compiled")
            for run_tree, methods_here in tree_runs:
                if run_tree is not None:
                    gen.set_tree(**dataclasses.asdict(run_tree))
                for method, div, threshold, kwargs in methods_here:
                    for temperature, children in sampling_rows(method, temperatures, children_kinds):
                        sampling = dict(temperature=temperature, top_p=a.top_p if temperature else 1.0)
                        planned = {"method": method, "divergence": div, "threshold": threshold, "backend": backend,
                                   **sampling, "children": children,
                                   "tree": "ar" if method == "ar" else gen.tree_for(temperature).label}
                        if not row_wanted(row_patterns(a.rows), planned, with_tree=bool(trees)):
                            continue
                        seeds = {p: a.seed + i for i, p in enumerate(prompts)} if temperature else None
                        row = bench_method(gen, prompts, a.max_new_tokens, a.repeats, seeds=seeds, **sampling,
                                           **kwargs, children=children)  # as named: a pool tree's default is "sampled"
                        row = {"method": method, "divergence": div, "threshold": threshold, "backend": backend,
                               **sampling, **({"children": children} if children != "top" else {}),
                               "tree": "ar" if method == "ar" else gen.tree_for(temperature).label,
                               "prompts": len(prompts), **({"head": head} if head else {}), **row}
                        row["name"] = _label(row, with_tree=bool(trees)) + (f"@{head_names[head]}" if head else "")
                        outputs[row["name"]] = row.pop("outputs", None)
                        rows.append(row)
                        # Every row so far, complete (speedups, agreement): a run cut short keeps what it measured.
                        write_text_atomic(partial, json.dumps(annotate(rows, outputs, device_name), default=str))
                        print(row["name"], round(row["tokens_per_s"], 1), "tok/s", "tau", round(row["tau"], 2),
                              row["mode"], row["attention"], flush=True)

    measure(gen, tree_runs)
    if trees:  # the stage breakdown, memory and metadata: the first tree
        tree = gen.set_tree(**dataclasses.asdict(trees[0]))
    extra = {}
    if dev.type == "cuda" and not a.rows_only:
        for backend in backends[-2:] if compiled else ["graph"]:
            gen.configure(cuda_graphs=True, compile=backend == "compiled")
            extra[f"stage_ms_per_round_{backend}"] = stage_breakdown(gen, prompts[0], compile=gen.compile)
            print(backend, extra[f"stage_ms_per_round_{backend}"], flush=True)
    gen.configure(cuda_graphs=True, compile=compiled and a.memory_compiled)
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
    tau = next((r["tau"] for r in rows if r["method"] == "eagle2" and r["backend"] == backends[-1]
                and not r.get("temperature") and r.get("tree") == tree.label and "head" not in r), None)
    if not a.skip_8b and not a.rows_only and dev.type == "cuda" and tau is not None:
        extra["llama3_8b_shape"] = llama8b_round_cost(gen.target.dtype, dev, tau, compiled)
    dtype_name = str(gen.target.dtype).replace("torch.", "")
    if a.compare_head:  # the same drafting rows with each other head, against the same plain-decoding rows
        tree_args = dataclasses.asdict(tree)
        gen.release()
        del gen
        for other in a.compare_head:
            gen = SpeculativeGenerator.load(target=a.target, head=other, device=a.device, dtype=a.dtype,
                                            threads=a.threads)
            gen.set_tree(**tree_args)
            measure(gen, [(t, [m for m in methods_here if m[0] != "ar"]) for t, methods_here in tree_runs], other)
            gen.release()
            del gen
    rows = annotate(rows, outputs, device_name)
    result = {"rows": rows, **extra,
              "meta": {"date": date.today().isoformat(), "device": device_name, "torch": torch.__version__,
                       "transformers": transformers.__version__, "dtype": dtype_name,
                       "threads": torch.get_num_threads(), "prompts": len(prompts), "tp_size": a.tp,
                       "prompt_source": a.prompts, "target": a.target or "default", "head": a.head,
                       "draft_model": a.draft_model, "compare_heads": a.compare_head or None,
                       "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, "tree": tree.to_dict(),
                       "trees": [t.label for t in trees] or None,
                       "temperatures": temperatures, "top_p": a.top_p, "children": children_kinds, "seed": a.seed,
                       "commit": a.code or git_commit(short=True), "inductor_freezing": freezing(),
                       "command": "python -m eval speed " + " ".join(argv if argv is not None else sys.argv[1:])}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    if a.out != os.devnull:
        write_text_atomic(a.out, json.dumps(result, indent=2, default=str) + "\n")
    for row in rows:
        print(f"{row['name']:34s} {row['tokens_per_s']:9.1f} tok/s  x{row['speedup_vs_hf']} vs HF  "
              f"x{row['speedup_vs_ar']} vs AR  tau {row['tau']:.2f}  mem {row['peak_mem_gb']}  "
              f"agree {row.get('agreement_vs_ar')}  vs greedy {row.get('vs_greedy')}")
    if extra:
        print(json.dumps(extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
