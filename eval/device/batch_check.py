"""Quick GPU check of batched decoding on the default model, the 80 MT-bench first turns, 128 new tokens:

    python eval/device/batch_check.py exact            # float32 graph rounds: 16 prompts in 8 rows == each alone
    python eval/device/batch_check.py exact-compiled   # the same with compiled rounds and prefills
    python eval/device/batch_check.py graph            # bf16 graph rounds: AR and EAGLE-2 tokens/s at batch 1, 8, 32
    python eval/device/batch_check.py speed,b1,b8      # bf16 compiled rounds at the batch sizes named (b1 b8 b32)
    python eval/device/batch_check.py lengths          # batched AR vs EAGLE-2 outputs (see below)

``lengths``: AR and EAGLE-2 in the default dtype (compiled on a GPU) on the prompts of ``python -m eval batch``
(every k-th of the 480 for PROMPTS=n, default all), NEW_TOKENS (256) each, at each batch size of BATCHES
(default 8): new tokens per configuration and how many outputs equal the first configuration's (AR at the
first batch size). Greedy EAGLE-2 is AR's output up to floating-point differences between shapes, so totals
far apart point at a bug rather than at rounding. Runs on the CPU too (RES=<folder>).

HEAD=<folder>: that draft head instead of the default model's shipped one (every step). ATTENTION=sdpa or
flex: the tree attention of compiled rounds in ``exact-compiled`` and ``lengths`` (default: the library's
choice, ``SpeculativeGenerator.use_attention``); ``exact*`` log which prompts differ. DECODERS=ar or eagle2:
``exact*`` checks that one only (default both, EAGLE-2 first).

Each configuration is warmed up on every prompt (a 4-token pass: every prefill bucket captured, the round
compiled) before the timed pass; results are appended to $RES/check.jsonl (default /root/res). The full
benchmark with the transformers baseline is ``python -m eval batch``."""
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fsd_eagle import SpeculativeGenerator  # noqa: E402
from eval.batch import load_prompts  # noqa: E402
from eval.tasks import load_mt_bench  # noqa: E402

RES = os.environ.get("RES", "/root/res")
ATTENTION = os.environ.get("ATTENTION") or None  # compiled rounds' tree attention (None: the library's choice)
DECODERS = os.environ.get("DECODERS", "eagle2,ar").split(",")  # what exact* checks
if not DECODERS or set(DECODERS) - {"ar", "eagle2"}:
    sys.exit(f"DECODERS is a comma-separated subset of ar,eagle2; got {os.environ['DECODERS']!r}")
HEAD = os.environ.get("HEAD") or None  # a draft head folder (None: the shipped head)
os.makedirs(RES, exist_ok=True)


def log(**kw):
    line = json.dumps(kw)
    print(line, flush=True)
    with open(f"{RES}/check.jsonl", "a") as f:
        f.write(line + "\n")


prompts = [q.turns[0] for q in load_mt_bench(limit=80)]
steps = sys.argv[1].split(",") if len(sys.argv) > 1 else ["exact", "speed"]
for step in ("exact", "exact-compiled"):
    if step not in steps:
        continue
    g = SpeculativeGenerator.load(head=HEAD, dtype="float32", compile=step == "exact-compiled")
    g.use_attention(ATTENTION)
    for ar in [name == "ar" for name in DECODERS]:
        t = time.perf_counter()
        alone = [g.generate(p, max_new_tokens=64, autoregressive=ar).token_ids for p in prompts[:16]]
        many = g.generate(prompts[:16], max_new_tokens=64, batch_size=8, autoregressive=ar)
        differ = [i for i, (a, m) in enumerate(zip(alone, many)) if a != m.token_ids]
        log(step=f"fp32_{step}", ar=ar, same=16 - len(differ), of=16, differ=differ, mode=many[0].stats.mode,
            attention=many[0].stats.attention, s=round(time.perf_counter() - t, 1))
    del g
    torch.cuda.empty_cache()


def measure(g, ar, bs, tag):
    t0 = time.perf_counter()
    g.generate(prompts, max_new_tokens=4, batch_size=bs, autoregressive=ar)  # every prefill bucket + capture
    warm = time.perf_counter() - t0
    torch.cuda.synchronize()
    t = time.perf_counter()
    res = g.generate(prompts, max_new_tokens=128, batch_size=bs, autoregressive=ar)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    toks = sum(r.stats.new_tokens for r in res)
    fw = sum(r.stats.target_forwards for r in res)
    log(step=tag, ar=ar, batch=bs, tok_s=round(toks / dt, 1), tau=round(toks / fw, 3), mode=res[0].stats.mode,
        attention=res[0].stats.attention, warm_s=round(warm, 1),
        mem_gb=round(torch.cuda.max_memory_allocated() / 2**30, 2))


if "lengths" in steps:
    n = int(os.environ.get("PROMPTS", "480"))
    new = int(os.environ.get("NEW_TOKENS", "256"))
    chosen = load_prompts(480)[::max(1, 480 // n)][:n]
    g = SpeculativeGenerator.load(head=HEAD, compile=torch.cuda.is_available())
    g.use_attention(ATTENTION)
    reference = None
    for bs in [int(b) for b in os.environ.get("BATCHES", "8").split(",")]:
        for ar in (True, False):
            t = time.perf_counter()
            res = g.generate(chosen, max_new_tokens=new, batch_size=bs, autoregressive=ar)
            ids = [r.token_ids for r in res]
            reference = reference or ids
            log(step="lengths", ar=ar, batch=bs, prompts=len(chosen), max_new_tokens=new, dtype=str(g.target.dtype),
                mode=res[0].stats.mode, attention=res[0].stats.attention, new_tokens=sum(len(x) for x in ids),
                same_as_first=sum(a == b for a, b in zip(reference, ids)), s=round(time.perf_counter() - t, 1))
        g.release()
    del g

if "graph" in steps:
    g = SpeculativeGenerator.load(head=HEAD)
    for bs in (1, 8, 32):
        for ar in (True, False):
            measure(g, ar, bs, "graph")
        g.release()
    del g
if "speed" in steps:
    g = SpeculativeGenerator.load(head=HEAD, compile=True)
    order = [(1, False), (1, True), (8, True), (8, False), (32, True), (32, False)]
    for bs, ar in order:
        if f"b{bs}" not in steps:
            continue
        measure(g, ar, bs, "compiled")
        if ar is False:
            g.release()
log(step="done")
