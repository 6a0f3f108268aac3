"""Tensor-parallel targets on one host's GPUs, in one command (rank 0 writes the result):

    torchrun --nproc-per-node 2 eval/device/tp_check.py --out eval/results/gpu_tp.json

1. Exactness: tiny random Llama and Qwen3 targets (fp32, greedy) decode the same tokens sharded over every
   rank (tp N) as whole on one GPU (tp 1, every rank for itself), eagerly and in CUDA graphs: plain
   decoding, EAGLE-2 with a random head, the target drafting for itself (a draft model: long accepted
   paths) and two prompts decoded together.
2. Speed: random-weight Llama-3-8B-shaped target at tp 1 (a copy per GPU, rank 0's numbers) and tp N, Qwen2.5-32B-shaped target
   at tp N (eval/random_models.py: zero-weight sparse folders, filled at random on the GPUs after loading),
   each with a random head of its shape: ms per round and tokens/s of AR and EAGLE-2 (tree 64/6/8, draft
   vocabulary 16,384, CUDA graphs; ``--compile`` also compiles), EAGLE-2's speedup projected at the tau
   the shipped head measured (read from the current batch-1 speed figure in eval/results/), and the tp N /
   tp 1 round-cost ratio of the 8B shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from eval.device.profile_round import kernel_table, replay_ms  # noqa: E402
from eval.random_models import (SHAPES, prompt_ids, randomize, write_head_folder, write_ids_tokenizer,  # noqa: E402
                                write_target_folder)
from fsd_eagle import parallel  # noqa: E402
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.config import TreeConfig  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402

TINY_TREE = dict(total_tokens=12, depth=3, top_k=3)
BIG_TREE = dict(total_tokens=64, depth=6, top_k=8, draft_vocab=16384)  # the H100 preset of the shipped head
TINY_PROMPTS = (list(range(3, 20)), list(range(40, 49)))
LONG_PROMPT = range(1000, 1512)  # token ids of the timed decodes' prompt (512 tokens)
REFERENCE = "gpu_sampling_pool16_h200_fb0e710.json"  # the current batch-1 speed figure (README)
TAU_FALLBACK = 3.902  # its MT-bench tau of the shipped head, greedy, compiled rounds, H200


def log(*parts) -> None:
    if parallel.is_main_rank():
        print(*parts, flush=True)


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def release(gen) -> None:
    """Free a generator's GPU memory (weights, caches, graphs)."""
    gen.release()
    del gen
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ exactness


def tiny_folders(work: Path) -> dict[str, tuple[Path, Path]]:
    """Per arch: a tiny random fp32 target folder and a random head folder (written by rank 0)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from fsd_eagle.head import EagleHead, HeadConfig
    from fsd_eagle.models import save_head

    common = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    configs = {"llama": LlamaConfig(**common), "qwen3": Qwen3Config(**common, head_dim=32)}
    out = {arch: (work / f"tiny-{arch}", work / f"tiny-{arch}-head") for arch in configs}
    if parallel.is_main_rank():
        for arch, config in configs.items():
            target, head = out[arch]
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False).float()
            with torch.no_grad():
                for param in model.parameters():
                    if param.dim() == 1:
                        param.add_(0.1 * torch.randn_like(param))
            model.save_pretrained(target)
            write_ids_tokenizer(target)
            save_head(EagleHead(HeadConfig.for_target(config)), head, dtype=torch.float32)
    barrier()
    return out


def decode_cases(target: Path, head: Path, tp_size: int, graphs: bool, device: str) -> dict:
    """Tokens (and how the rounds ran) of every case on one target: AR, EAGLE-2 with ``head``, the target as
    its own draft model, two prompts together."""
    out, modes = {}, set()
    for name, kwargs in (("head", dict(head=head)), ("draft_model", dict(draft_model=target))):
        gen = SpeculativeGenerator.load(target, device=device, dtype="float32", tree=TreeConfig(**TINY_TREE),
                                        tp_size=tp_size, **kwargs)
        gen.configure(cuda_graphs=graphs)
        if name == "head":
            r = gen.generate(TINY_PROMPTS[0], 24, autoregressive=True, chat=False)
            out["ar"], modes = r.token_ids, modes | {r.stats.mode}
            rs = gen.generate([list(p) for p in TINY_PROMPTS], 24, chat=False)
            out["batch"], modes = [r.token_ids for r in rs], modes | {r.stats.mode for r in rs}
        r = gen.generate(TINY_PROMPTS[0], 24, chat=False)
        out[name], out[f"{name}_tau"], modes = r.token_ids, round(r.stats.tau, 3), modes | {r.stats.mode}
        release(gen)
    out["modes"] = sorted(modes)
    return out


def check_exactness(work: Path, tp_size: int, device: str) -> dict:
    """tp 1 against tp ``tp_size``, eager and graph rounds, per arch; every rank compares its own."""
    import torch.distributed as dist

    folders = tiny_folders(work)
    report = {}
    for arch, (target, head) in folders.items():
        for graphs in (False, True):
            label = f"{arch}_{'graph' if graphs else 'eager'}"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                one = decode_cases(target, head, 1, graphs, device)
                many = decode_cases(target, head, tp_size, graphs, device)
            cases = ("ar", "head", "draft_model", "batch")
            same = {c: one[c] == many[c] for c in cases}
            graph_ran = not graphs or device == "cpu" or many["modes"] == ["graph"]
            ok = all(same.values()) and graph_ran
            flags = [None] * dist.get_world_size()
            dist.all_gather_object(flags, ok)
            report[label] = {"identical": same, "all_ranks_ok": all(flags), "modes_tp1": one["modes"],
                             "modes_tp": many["modes"], "tau_draft_model": many["draft_model_tau"],
                             "tau_head": many["head_tau"], "tokens": len(many["ar"]),
                             "capture_warnings": sorted({str(w.message)[:160] for w in caught
                                                         if "capture" in str(w.message)})}
            log(label, "identical" if all(flags) else "DIFFERENT", same, "modes", one["modes"], many["modes"])
    report["all_identical"] = all(v["all_ranks_ok"] for v in report.values() if isinstance(v, dict))
    return report


# ------------------------------------------------------------------------------------------ speed


def reference_tau() -> tuple[float, str]:
    """The shipped head's MT-bench tau, greedy, compiled rounds, from the current batch-1 speed figure."""
    path = ROOT / "eval" / "results" / REFERENCE
    try:
        data = json.loads(path.read_text())
        row = next(r for r in data["rows"] if r.get("method") == "eagle2" and r.get("backend") == "compiled"
                   and not r.get("temperature"))
        return float(row["tau"]), f"eval/results/{REFERENCE} {row['name']} ({data['meta'].get('device')})"
    except (OSError, KeyError, StopIteration, ValueError, TypeError):
        return TAU_FALLBACK, f"default (no greedy compiled EAGLE row in eval/results/{REFERENCE})"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    """Seconds of ``fn()`` on a synchronized clock."""
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def bench_target(target: Path, head: Path, tp_size: int, prompts: list[list[int]], max_new_tokens: int,
                 rounds: int, compile: bool, device: str, batch: int = 1, kernels: bool = False) -> dict:
    """Per method (AR, EAGLE-2) on one random-weight target folder: the cost of one round (a decode of
    ``rounds`` rounds after a 512-token prompt, in each of ``batch`` rows), tokens/s over ``prompts``
    (``batch`` at a time), and the captured round's GPU time replayed back to back.

    ms_per_round: wall time of the decoding rounds after the prefill (the call's time less its time to the
    first token, per round); ms_per_call_round: the whole call (512-token prefill included) per target
    forward; replay_ms_per_round: GPU time of the captured round replayed back to back on every rank (the
    difference to ms_per_round is host time between rounds); ``kernels``: rank 0's kernel table of one
    replayed round (GEMMs, attention, all-reduces, the rest)."""
    t = time.perf_counter()
    gen = SpeculativeGenerator.load(target, head=head, device=device, dtype="bfloat16", tree=TreeConfig(**BIG_TREE),
                                    tp_size=tp_size, compile=compile)
    randomize(gen)
    out = {"load_s": round(time.perf_counter() - t, 1), "tp_size": tp_size}
    if torch.cuda.is_available():
        out["gpu_mem_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    long_prompt = list(LONG_PROMPT)
    for name, ar in (("ar", True), ("eagle2", False)):
        t = time.perf_counter()
        gen.generate([long_prompt] * batch, 8, autoregressive=ar, chat=False, batch_size=batch)  # capture
        gen.generate(prompts, 2, autoregressive=ar, chat=False, batch_size=batch)  # every prefill graph
        warmup_s = time.perf_counter() - t
        box = {}
        barrier()
        seconds = timed(lambda: box.update(r=gen.generate([long_prompt] * batch, rounds + 1, autoregressive=ar,
                                                          chat=False, batch_size=batch)))
        r = max(box["r"], key=lambda x: x.stats.target_forwards)
        s = r.stats
        results = []
        barrier()
        total = timed(lambda: results.extend(gen.generate(prompts, max_new_tokens, autoregressive=ar, chat=False,
                                                          batch_size=batch)))
        tokens = sum(x.stats.new_tokens for x in results)
        forwards = sum(x.stats.target_forwards for x in results)
        out[name] = {"ms_per_round": round(1000 * (s.elapsed_s - s.prefill_s) / max(1, s.target_forwards - 1), 3),
                     "ms_per_call_round": round(1000 * seconds / s.target_forwards, 3),
                     "tokens_per_s": round(tokens / total, 2), "tau": round(tokens / forwards, 3),
                     "mode": s.mode, "attention": s.attention, "warmup_s": round(warmup_s, 1)}
        session = gen.session(autoregressive=ar, batch=batch)  # the one these calls used
        if session.graph is not None:
            gen.generate([long_prompt] * batch, 1, autoregressive=ar, chat=False, batch_size=batch)  # fresh state
            barrier()
            out[name]["replay_ms_per_round"] = round(replay_ms(session.graph[0]), 3)
            if kernels:
                out[name]["kernels"] = kernel_table(session, top=12)
        log(f"  tp {tp_size} {name}: {out[name]}")
    release(gen)
    return out


def project(row: dict, tau: float) -> None:
    """EAGLE-2's speedup over AR and its decoding tokens/s at the shipped head's ``tau``."""
    ar, eagle = row["ar"]["ms_per_round"], row["eagle2"]["ms_per_round"]
    row["projected_speedup_at_tau"] = round(tau * ar / eagle, 3)
    row["projected_eagle2_tokens_per_s_at_tau"] = round(1000 * tau / eagle, 1)


def check_speed(work: Path, tp_size: int, prompts: list[str], a) -> dict:
    """The 8B shape at tp 1 (every rank its own copy) and tp ``tp_size``, the 32B shape at tp ``tp_size``."""
    folders = {}
    for shape in ("llama3-8b", "qwen2.5-32b"):
        target, head = work / shape, work / f"{shape}-head"
        if parallel.is_main_rank():
            write_target_folder(SHAPES[shape](), target)
            write_head_folder(target, head)
        folders[shape] = (target, head)
    barrier()
    tau, source = reference_tau()
    runs = [("llama3-8b", 1), ("llama3-8b", tp_size), ("qwen2.5-32b", tp_size)]
    rows = []
    for shape, size in runs:
        if a.skip_32b and shape == "qwen2.5-32b":
            continue
        ids = [prompt_ids(p, SHAPES[shape]().vocab_size) for p in prompts]
        log(f"{shape} tp {size}")
        # tp 1: every rank loads a whole copy onto its own GPU at the same time (transformers' loading joins
        # collectives when a process group exists, so no rank may load alone); rank 0's numbers are reported.
        row = {"shape": shape, "batch": a.batch, **bench_target(*folders[shape], size, ids, a.max_new_tokens,
                                                                a.rounds, a.compile, a.device, a.batch,
                                                                a.kernels)}
        project(row, tau)
        rows.append(row)
    out = {"rows": rows, "tau": tau, "tau_source": source, "tree": BIG_TREE}
    one = next((r for r in rows if r["shape"] == "llama3-8b" and r["tp_size"] == 1), None)
    many = next((r for r in rows if r["shape"] == "llama3-8b" and r["tp_size"] == tp_size), None)
    if one and many:
        out["llama3_8b_tp_over_tp1"] = {m: round(many[m]["ms_per_round"] / one[m]["ms_per_round"], 3)
                                        for m in ("ar", "eagle2")}
        out["llama3_8b_tp_over_tp1_replay"] = {
            m: round(many[m]["replay_ms_per_round"] / one[m]["replay_ms_per_round"], 3)
            for m in ("ar", "eagle2") if "replay_ms_per_round" in one[m] and "replay_ms_per_round" in many[m]}
        out["goal_tp2_over_tp1_at_most"] = 0.65
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N eval/device/tp_check.py")
    p.add_argument("--out", default=str(ROOT / "eval" / "results" / "gpu_tp.json"))
    p.add_argument("--work", default="/tmp/fsd-tp", help="folder for the random-weight model folders")
    p.add_argument("--prompts", type=int,
                   help="MT-bench first turns of the tokens/s runs (default: 8, or --batch when larger, so that "
                        "the batched tokens/s decode full batches)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=30, help="rounds of the ms-per-round decode")
    p.add_argument("--compile", action="store_true", help="also compile the speed runs' rounds (slow first calls)")
    p.add_argument("--skip-exact", action="store_true")
    p.add_argument("--skip-speed", action="store_true")
    p.add_argument("--skip-32b", action="store_true")
    p.add_argument("--kernels", action="store_true", help="add a kernel table of one replayed round per method")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together in the speed runs")
    p.add_argument("--device", default="cuda", help="cuda (cpu: a gloo smoke run on a machine without CUDA)")
    p.add_argument("--code", help="the commit of the code run, recorded in the result (default: git's HEAD)")
    a = p.parse_args(argv)
    a.prompts = a.prompts or max(8, a.batch)
    world = parallel.launched_world()
    if world is None or world < 2:
        print("error: launch with torchrun --nproc-per-node N (N >= 2)", file=sys.stderr)
        return 2
    import transformers

    from eval.runinfo import git_commit, versions
    from eval.tasks import load_mt_bench
    from fsd_eagle import tp_allreduce
    from fsd_eagle.cli import quiet_transformers

    quiet_transformers()
    tp = parallel.start(world, a.device)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(tp.device) if tp.device.type == "cuda" else "cpu"
    result = {"meta": {"date": date.today().isoformat(), "device": name,
                       "gpus": world, **versions(), "transformers": transformers.__version__,
                       "code": a.code or git_commit(short=True),
                       "command": "torchrun --nproc-per-node " + str(world) + " eval/device/tp_check.py "
                                  + " ".join(argv if argv is not None else sys.argv[1:]),
                       "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "batch": a.batch,
                       "compile": a.compile, "tp_allreduce": tp_allreduce.mode()}}
    if not a.skip_exact:
        result["exactness"] = check_exactness(work, world, a.device)
    if not a.skip_speed:
        prompts = [q.turns[0] for q in load_mt_bench(limit=a.prompts)]
        result["speed"] = check_speed(work, world, prompts, a)
    result["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    if tp.is_main:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(a.out, json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.get("speed", {}).items() if k != "rows"}), flush=True)
        print("wrote", a.out, flush=True)
    barrier()
    import torch.distributed as dist

    dist.destroy_process_group()
    ok = result.get("exactness", {}).get("all_identical", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
