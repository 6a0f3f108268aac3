"""Micro-benchmarks of the small ops a decoding round is made of, each compiled and replayed in a CUDA graph
(the form they take in a round), on the shapes of SmolLM2-135M-Instruct with a 48-node tree:

- top-k over the draft's vocabulary (rows x V float32 logits, k = top_k): torch.topk, two-stage variants,
  fsd_eagle.kernels.topk (checked against torch.topk first), and the small top-k over the k x k children;
- ``pool_topk``: the pool of sampled children (k = 8, 16 and 32 over a 16,384-token draft vocabulary, 1 and
  8 rows): fsd_eagle.kernels.topk as a round runs it, its kernels with other chunk sizes and warps, the
  max-reduction kernels of topk_passes.py (each checked against torch.topk), torch.topk;
- FlexAttention for 1, 8 and 48 query rows over a 2048-slot cache with a ~500-token prefix, under
  kernel_options (query/key tile sizes, warps, stages);
- one layer's tree attention of a batched round (``batch``): B = 8 or 64 rows of n = 1 (AR) or 64 (a
  tree) new tokens, each row with its own prefix (40 to 1,500 tokens) over a 2048-slot cache, through
  ``attention.attend`` as rounds call it: SDPA under the dense mask (every slot read) with keys and values
  repeated per query head and with the packed mask (no copies), FlexAttention with per-row lists (written
  per head) and with shared lists; each also checked against the first (largest absolute difference).

    python eval/device/bench_ops.py --out $OUT/bench_ops.json [--skip topk,flex,batch]
"""

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsd_eagle.attention import prepare_mask  # noqa: E402
from fsd_eagle.cache import SlotMask  # noqa: E402
from fsd_eagle.decode import capture  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402
from fsd_eagle.kernels import topk as kernel_topk  # noqa: E402
from profile_round import replay_ms  # noqa: E402


def graph_us(fn, reps: int = 50) -> float:
    """GPU microseconds per call of ``fn`` (compiled, warmed up, captured ``reps`` times in one graph)."""
    captured = capture(lambda: [fn() for _ in range(reps)], [])
    if captured is None:
        raise RuntimeError("CUDA graph capture failed")
    graph = captured[0]
    graph.replay()  # one untimed replay
    torch.cuda.synchronize()
    return round(replay_ms(graph, 5) * 1000 / reps, 2)


def two_stage(x, k, chunk, sort_first=False):
    v = x.shape[-1]
    pad = -v % chunk
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    y = x.unflatten(-1, (-1, chunk))
    if sort_first:
        vals, idx = y.sort(-1, descending=True)
        vals, idx = vals[..., :k], idx[..., :k]
    else:
        vals, idx = y.topk(k, sorted=False)
    idx = idx + torch.arange(0, v + pad, chunk, device=x.device).unsqueeze(-1)
    vals, best = vals.flatten(-2).topk(k)
    return vals, idx.flatten(-2).gather(-1, best)


def bench_topk(v: int, k: int) -> list[dict]:
    rows = []
    for shape in [(k, v), (1, v), (1, k * k), (3, 5000), (2, 262144), (k, 128256)]:
        x = torch.randn(*shape, device="cuda")
        x[-1, 100:300] = 5.0  # ties
        got, ref = kernel_topk(x, k), x.topk(k)
        assert torch.equal(got[0], ref.values), shape
        assert torch.equal(x.gather(1, got[1]), got[0]) and all(len(set(r)) == k for r in got[1].tolist()), shape
        if shape[0] > 1:
            assert torch.equal(got[1][:-1], ref.indices[:-1]), shape
    rows.append({"op": "kernel_topk_check", "ok": True})
    for r in (1, k):
        x = torch.randn(r, v, device="cuda")
        variants = {
            "kernel_topk": lambda x=x: kernel_topk(x, k),
            "topk": lambda x=x: x.topk(k),
            "topk_bf16_then_gather": lambda x=x: x.gather(-1, x.bfloat16().topk(k).indices),
            "logsumexp": lambda x=x: x.logsumexp(-1),
            "log_softmax_topk": lambda x=x: torch.log_softmax(x, -1).topk(k),
        }
        for chunk in (256, 1024, 4096):
            variants[f"two_stage_{chunk}"] = lambda x=x, c=chunk: two_stage(x, k, c)
        for chunk in (1024, 4096):
            variants[f"two_stage_sort_{chunk}"] = lambda x=x, c=chunk: two_stage(x, k, c, True)
        for name, fn in variants.items():
            rows.append({"op": "topk", "rows": r, "V": v, "k": k, "variant": name,
                         "us": graph_us(torch.compile(fn, dynamic=False))})
            print(json.dumps(rows[-1]), flush=True)
    small = torch.randn(k * k, device="cuda")
    for name, fn in {"topk": lambda: small.topk(k), "sort": lambda: small.sort(descending=True),
                     "kernel_topk": lambda: kernel_topk(small[None], k)}.items():
        rows.append({"op": "small_topk", "n": k * k, "k": k, "variant": name, "us": graph_us(fn)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_pool_topk() -> list[dict]:
    import topk_passes
    from fsd_eagle.kernels import jit_kernels, launch_topk

    passes = (topk_passes.chunk_topk_passes, topk_passes.merge_topk_passes)
    sort = jit_kernels()
    rows = []
    for v, r, k in itertools.product((16384,), (1, 8), (8, 16, 32)):
        x = torch.randn(r, v, device="cuda")
        ref = x.topk(k)
        variants = {"kernel_topk": lambda x=x: kernel_topk(x, k), "torch_topk": lambda x=x: x.topk(k)}
        for chunk, warps in itertools.product((512, 1024, 2048), (1, 2, 4)):
            variants[f"passes_c{chunk}_w{warps}"] = lambda x=x, c=chunk, w=warps: launch_topk(x, k, *passes, c, w)
        for chunk, warps in itertools.product((512, 1024, 2048, 4096), (2, 4, 8)):
            variants[f"sort_c{chunk}_w{warps}"] = lambda x=x, c=chunk, w=warps: launch_topk(x, k, *sort, c, w)
        for name, fn in variants.items():
            try:
                vals, idx = fn()
                if not (torch.equal(vals, ref.values) and torch.equal(idx, ref.indices)):
                    raise ValueError("differs from torch.topk")
                us = graph_us(fn)
            except Exception as e:  # a configuration Triton cannot build (registers, shared memory): report it
                us = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            rows.append({"op": "pool_topk", "rows": r, "V": v, "k": k, "variant": name, "us": us})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_flex(heads: int, kv_heads: int, dim: int, slots: int, prefix: int) -> list[dict]:
    from torch.nn.attention.flex_attention import flex_attention

    rows = []
    k = torch.randn(1, kv_heads, slots, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    options = [None, {"BLOCK_M": 64}, {"BLOCK_M": 16}, {"BLOCK_M": 64, "BLOCK_N": 64},
               {"BLOCK_M": 16, "BLOCK_N": 64}, {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 2, "num_stages": 1}]
    for n in (1, 8, 48):
        q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16)
        idx = torch.arange(n, device="cuda")
        anc = (idx.unsqueeze(1) >= idx.unsqueeze(0)).unsqueeze(0)  # one batch row: [1, n, n]
        mask = SlotMask(torch.tensor([prefix], device="cuda"), anc, slots)
        block_mask = prepare_mask(mask, "flex", torch.bfloat16)
        for opts in options:
            torch._dynamo.reset()  # one compile per option (the recompile limit is 8)
            fn = torch.compile(lambda q, o=opts: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True,
                                                                 kernel_options=o), dynamic=False)
            try:
                us = graph_us(lambda: fn(q))
            except Exception as e:  # an option this Triton/inductor cannot lower: report it, go on
                us = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append({"op": "flex", "q_rows": n, "heads": f"{heads}/{kv_heads}x{dim}", "slots": slots,
                         "prefix": prefix, "kernel_options": opts, "us": us})
            print(json.dumps(rows[-1]), flush=True)
        sdpa = torch.compile(lambda q: torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1),
            attn_mask=prepare_mask(mask, "sdpa", torch.bfloat16)), dynamic=False)
        rows.append({"op": "sdpa_masked_full_cache", "q_rows": n, "us": graph_us(lambda: sdpa(q))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_batch(heads: int, kv_heads: int, dim: int, slots: int) -> list[dict]:
    from fsd_eagle.attention import attend, block_mask

    rows = []
    gen = torch.Generator().manual_seed(0)
    for b, n in itertools.product((8, 64), (1, 64)):
        q = torch.randn(b, heads, n, dim, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(b, kv_heads, slots, dim, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn_like(k)
        prefix = torch.randint(40, min(1500, slots - n), (b,), generator=gen).cuda()
        anc = ((torch.rand(b, n, n, generator=gen) < 0.5).tril() | torch.eye(n, dtype=torch.bool)).cuda()
        mask = SlotMask(prefix, anc, slots)
        forms = {"sdpa": prepare_mask(mask, "sdpa", torch.bfloat16),
                 "sdpa_packed": prepare_mask(mask, "sdpa", torch.bfloat16, heads, kv_heads),
                 "flex_per_row": block_mask(mask, heads=heads), "flex_shared": block_mask(mask, shared=True)}
        want = attend(q, k, v, forms["sdpa"]).float()
        for name, m in forms.items():
            torch._dynamo.reset()
            fn = torch.compile(lambda q, m=m: attend(q, k, v, m), dynamic=False)
            err = round(float((fn(q).float() - want).abs().max()), 5)
            rows.append({"op": f"batch_attention_{name}", "batch": b, "q_rows": n, "slots": slots,
                         "prefixes_mean": round(float(prefix.float().mean()), 1), "us": graph_us(lambda: fn(q)),
                         "max_abs_diff_vs_sdpa": err})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def small_query_attention(q, k, v, mask, scale=None):
    """Attention of few query rows by matmuls (the form a CUDA-graph round could use instead of one SDPA kernel
    over the whole cache): packed queries ``[B, H_kv, g*n, d]``, keys/values ``[B, H_kv, S, d]``, additive mask
    ``[B, 1, g*n, S]``; scores and softmax in float32, probabilities times values in the inputs' dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale).add_(mask.float())
    return torch.matmul(s.softmax(-1).to(v.dtype), v)


def bench_decode(shapes: dict, slots_list=(768, 2048)) -> list[dict]:
    """One layer's attention of a batch-1 round in an (uncompiled) CUDA graph, as graph rounds run it: SDPA
    with the packed mask (``attention.attend``; the kernel SDPA picks, and with cuDNN's excluded) against
    ``small_query_attention``, for AR (n = 1) and a 64-node tree, the prefix filling all but the last 64
    slots; each checked against float32 SDPA."""
    from fsd_eagle.attention import attend, no_cudnn

    def without_cudnn(fn):
        def run():
            with no_cudnn():
                return fn()
        return run

    rows = []
    gen = torch.Generator().manual_seed(0)
    for (name, (heads, kv_heads, dim)), slots, n in itertools.product(shapes.items(), slots_list, (1, 64)):
        q = torch.randn(1, heads, n, dim, generator=gen).to("cuda", torch.bfloat16)
        k = torch.randn(1, kv_heads, slots, dim, generator=gen).to("cuda", torch.bfloat16)
        v = torch.randn_like(k)
        anc = ((torch.rand(1, n, n, generator=gen) < 0.5).tril() | torch.eye(n, dtype=torch.bool)).cuda()
        mask = SlotMask(torch.tensor([slots - 64], device="cuda"), anc, slots)
        packed = prepare_mask(mask, "sdpa", torch.bfloat16, heads, kv_heads)
        g = heads // kv_heads
        want = attend(q.float(), k.float(), v.float(), prepare_mask(mask, "sdpa", torch.float32, heads, kv_heads))
        qp = q.reshape(1, kv_heads, g * n, dim)
        forms = {"sdpa_packed": lambda: attend(q, k, v, packed),
                 "sdpa_packed_no_cudnn": without_cudnn(lambda: attend(q, k, v, packed)),
                 "matmul_softmax": lambda: small_query_attention(qp, k, v, packed).reshape(1, heads, n, dim)}
        for form, fn in forms.items():
            err = round(float((fn().float() - want).abs().max()), 5)
            rows.append({"op": "decode_attention", "shape": name, "heads": f"{heads}/{kv_heads}x{dim}",
                         "q_rows": n, "slots": slots, "form": form, "us": graph_us(fn, 20),
                         "max_abs_diff_vs_fp32": err})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--skip", default="", help="comma list of sections to skip: topk,pool_topk,flex,batch,decode")
    a = p.parse_args()
    skip = set(a.skip.split(","))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    if "topk" not in skip:
        out["rows"] += bench_topk(49152, 8)
    if "pool_topk" not in skip:
        out["rows"] += bench_pool_topk()
    if "flex" not in skip:
        out["rows"] += bench_flex(9, 3, 64, 2048, 500)
    if "batch" not in skip:
        out["rows"] += bench_batch(9, 3, 64, 2048)
    if "decode" not in skip:
        out["rows"] += bench_decode({"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)})
    write_text_atomic(a.out, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
