"""Per-round GPU cost of batched decoding on a random-weight target of the default model's shape, with the
shipped head (round costs do not depend on the weights; tau does, so none is reported). For each batch size
and tree: the wall seconds of the first call (compilation and capture), GPU ms per replayed round, and the
kernels of one round by GPU time. Needs no model download:

    python eval/device/round_cost.py --batches 1,8 --trees ar,64/6/8,32/5/8 --out $OUT/cost.json

``--temperatures 0,0.7`` times the sampling rounds too (top-p 1), ``--children top,sampled`` those with the
tree's top children and/or children sampled from the drafter; ``--trace DIR`` writes a chrome trace of one
replayed round per row (every kernel in launch order with its duration) to
DIR/<batch>_<tree>_t<T>[_sampled].json.

Batch sessions compile their rounds with a symbolic batch size (fsd_eagle.decode.compiled_round), so after
the first batch size above 1 the others start without compiling.
"""

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.device.profile_round import export_trace, kernel_table, replay_ms  # noqa: E402
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.config import TreeConfig  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402
from fsd_eagle.head import EagleHead, HeadConfig  # noqa: E402
from fsd_eagle.models import load_head, read_head_config  # noqa: E402

# SmolLM2-135M-Instruct's shape (its config.json)
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
             rms_norm_eps=1e-5, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
HEAD = Path(__file__).resolve().parents[2] / "fsd_eagle" / "heads" / "SmolLM2-135M-Instruct"


class NoText:
    """Stands in for a tokenizer: prompts are token ids here, and no text is wanted back."""

    eos_token_id = None

    def decode(self, ids, **kwargs) -> str:
        return ""


def random_head(config: transformers.LlamaConfig) -> EagleHead:
    """A random-weight head of the shipped head's shape (its config.json alone: arch, fused layers, draft
    vocabulary), for runs whose tree carries no head weights: round costs and compilation do not depend on
    the weights."""
    shipped = read_head_config(HEAD)
    cfg = dataclasses.replace(HeadConfig.for_target(config), arch=shipped["arch"], layers=tuple(shipped["layers"]),
                              draft_vocab_size=shipped["draft_vocab_size"],
                              intermediate_size=shipped["intermediate_size"])
    return EagleHead(cfg)  # its vocabulary map starts as the first draft_vocab_size ids


def random_generator(dtype: torch.dtype, random_weights_head: bool = False) -> SpeculativeGenerator:
    """The default model's shape with random weights, and the shipped head (``random_weights_head``: a
    random head of its shape, see ``random_head``), compiled."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE)
    model = transformers.LlamaForCausalLM(config).to("cuda", dtype).eval()
    if random_weights_head:
        head = random_head(config).to("cuda", dtype).eval()
    else:
        head = load_head(HEAD, config, torch.device("cuda"), dtype)
    gen = SpeculativeGenerator(model, NoText(), head)
    gen.configure(compile=True)
    return gen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,8")
    p.add_argument("--trees", default="ar,64/6/8", help="comma-separated; the shipped EAGLE-3 head drafts over its own "
                   "vocabulary, so no /v<draft_vocab> (that is for heads with a token ranking)")
    p.add_argument("--prompt-len", type=int, default=120)
    p.add_argument("--temperatures", default="0", help="comma-separated; 0 is greedy")
    p.add_argument("--children", default="top", help="comma-separated: top and/or sampled (sampling rows only)")
    p.add_argument("--kernels", type=int, default=20, help="kernels listed per round (0: no table)")
    p.add_argument("--trace", help="folder for a chrome trace of one replayed round per row")
    p.add_argument("--random-head", action="store_true",
                   help="a random head of the shipped head's shape (no head weights needed)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    temperatures = [float(x) for x in a.temperatures.split(",")]
    gen = random_generator(torch.bfloat16, a.random_head)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "transformers": transformers.__version__, "command": "python " + " ".join(sys.argv), "rows": []}
    for b in (int(x) for x in a.batches.split(",")):
        prompts = [torch.randint(10, 49000, (a.prompt_len + 7 * i,)).tolist() for i in range(b)]
        for name, temperature, children in itertools.product(a.trees.split(","), temperatures, a.children.split(",")):
            ar = name == "ar"
            if children != "top" and (ar or temperature == 0):
                continue  # only drafting rows that sample have children to sample
            if not ar:
                t = TreeConfig.parse(name)
                gen.set_tree(**dataclasses.asdict(t))
            call = dict(batch_size=b, autoregressive=ar, temperature=temperature, seed=0, children=children)
            start = time.perf_counter()
            gen.generate(prompts, max_new_tokens=16, **call)
            first = time.perf_counter() - start
            session = gen.session(autoregressive=ar, batch=b, temperature=temperature, children=children)
            gen.generate(prompts, max_new_tokens=2, **call)  # rows decoding again
            row = {"batch": b, "tree": name, "temperature": temperature, "children": children, "mode": session.mode,
                   "first_call_s": round(first, 1),
                   "replay_ms": round(replay_ms(session.graph[0]), 3) if session.graph else None}
            if a.kernels and session.graph:
                row["kernels"] = kernel_table(session, top=a.kernels)
            if a.trace and session.graph:
                Path(a.trace).mkdir(parents=True, exist_ok=True)
                suffix = "_sampled" if children == "sampled" else ""
                export_trace(session, str(Path(a.trace) / f"{b}_{name.replace('/', '-')}_t{temperature}{suffix}.json"))
            out["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            write_text_atomic(a.out, json.dumps(out, indent=1))
        gen.release()
    try:
        out["compile_times"] = torch._dynamo.utils.compile_times(repr="str")
    except (AttributeError, TypeError) as e:
        out["compile_times"] = f"unavailable: {e}"
    write_text_atomic(a.out, json.dumps(out, indent=1))
    print(out["compile_times"])


if __name__ == "__main__":
    main()
