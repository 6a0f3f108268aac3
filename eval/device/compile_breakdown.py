"""Where a round's compilation goes: compiles one round (one-row static, or batched with the batch size
symbolic, as fsd_eagle.decode.compiled_round does) on a random-weight target of the default model's shape
with the shipped head, and reports dynamo's and inductor's timers (torch._dynamo.utils.compile_times), the
graph's FX node count (total and per decoder layer), graph breaks, and the sympy warnings that symbolic
shapes produce ("failed while executing pow_by_natural(...)"), counted, with the stack of the first few.

    python eval/device/compile_breakdown.py --batch 4 --layers 30 --out $OUT/compile_breakdown.json
    python eval/device/compile_breakdown.py --device cpu --backend aot_eager --batch 4   # no inductor

Needs no model download. ``--layers`` keeps fewer decoder layers (a quicker compilation of the same code).
"""

import argparse
import collections
import json
import logging
import re
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from eval.device.round_cost import HEAD, SHAPE, NoText  # noqa: E402
from fsd_eagle import decode  # noqa: E402
from fsd_eagle.api import SpeculativeGenerator  # noqa: E402
from fsd_eagle.config import TreeConfig  # noqa: E402
from fsd_eagle.jsonl import write_text_atomic  # noqa: E402
from fsd_eagle.models import load_head  # noqa: E402
from fsd_eagle.session import Plan, Session  # noqa: E402
from fsd_eagle.verify import AcceptanceRule  # noqa: E402


class SympyWarnings(logging.Handler):
    """Counts the warnings of torch's sympy interpreter and keeps the stacks of the first few."""

    def __init__(self, keep: int = 3) -> None:
        super().__init__(logging.WARNING)
        self.count, self.keep = collections.Counter(), keep
        self.examples: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.count[msg.split("(")[0]] += 1
        if len(self.examples) < self.keep:
            stack = [line.strip() for line in traceback.format_stack()[:-6] if "site-packages/torch/" in line
                     or "fsd_eagle" in line]
            self.examples.append({"message": msg[:300], "stack": stack[-12:]})


def layer_nodes(gm: torch.fx.GraphModule) -> dict:
    """FX nodes by decoder layer of the target (nn_module_stack), the rest counted apart."""
    per_layer = collections.Counter()
    for node in gm.graph.nodes:
        path = " ".join(str(p) for p, _ in (node.meta.get("nn_module_stack") or {}).values())
        m = re.search(r"layers(?:\.|\[['\"]?)(\d+)", path)
        per_layer[int(m.group(1)) if m and "decoder_layers" not in path else None] += 1
    layers = sorted(v for k, v in per_layer.items() if k is not None)
    return {"nodes": len(gm.graph.nodes), "target_layers": len(layers),
            "nodes_per_layer_median": layers[len(layers) // 2] if layers else 0,
            "nodes_in_layers": sum(layers)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--batch", type=int, default=4, help="1: a one-row static round; more: batch symbolic")
    p.add_argument("--tree", default="64/6/8/16384", help="total/depth/top_k/draft_vocab")
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--attention", default="flex")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": a.layers})
    model = transformers.LlamaForCausalLM(config).to(dev, dtype).eval()
    gen = SpeculativeGenerator(model, NoText(), load_head(HEAD, config, dev, dtype))
    total, depth, k, vocab = (int(x) for x in a.tree.split("/"))
    tree = TreeConfig(total_tokens=total, depth=depth, top_k=k, draft_vocab=vocab)
    rule = AcceptanceRule()
    session = Session(gen.engine, Plan(tree, rule.form, True, False, False, None, a.batch))
    session.prepare_attention(a.attention)
    session.allocate(2048)
    prompts = [torch.arange(100 + 7 * i, 220 + 7 * i, device=dev) for i in range(a.batch)]
    session.start_rows(list(range(a.batch)), prompts, [rule] * a.batch, list(range(a.batch)))

    graphs = []

    def backend(gm, inputs):
        graphs.append(layer_nodes(gm))
        return torch._dynamo.lookup_backend(a.backend)(gm, inputs)

    warnings = SympyWarnings()
    logging.getLogger("torch.utils._sympy.interp").addHandler(warnings)
    torch._dynamo.reset()
    compiled = torch.compile(decode.run_round, backend=backend, dynamic=None if a.batch > 1 else False)
    if a.batch > 1:
        decode.mark_batch_dynamic(session.target, session.drafter, session.state)
    start = time.perf_counter()
    with torch.fx.experimental._config.patch(use_duck_shape=False):
        compiled(session.target, session.drafter, session.state, tree, session.form)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    counters = torch._dynamo.utils.counters
    out = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "backend": a.backend, "batch": a.batch, "tree": a.tree,
           "layers": a.layers, "attention": a.attention, "first_call_s": round(wall, 1), "graphs": graphs,
           "graph_breaks": sum(counters["graph_break"].values()),
           "compile_times_s": {n: round(float(v), 2) for n, v in zip(names, values) if float(v) >= 0.05},
           "sympy_warnings": dict(warnings.count), "sympy_warning_examples": warnings.examples}
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        write_text_atomic(a.out, text)


if __name__ == "__main__":
    main()
