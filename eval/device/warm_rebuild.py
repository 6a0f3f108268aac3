"""What it costs a process to make a configuration's compiled session when the compile cache is already warm,
as a server does when a configuration takes over from graph rounds or after a restart
(fsd_eagle.server.compiler.make_compiled: the session compiled with torch.compile, captured and warmed up
for the lanes). Each phase is its own process on one shared, initially empty compile cache:

- ``cold``: the first build (what the server's compiling process does on a fresh machine);
- ``warm``: the same build in a new process on the warm cache (a restart);
- ``graph-first``: a new process that first decodes on the graph session of the same configuration, then
  makes the compiled one (what the server's engine thread does between two rounds);
- ``precompile``: ``warm`` with dynamo's caching precompile on, where this torch has it (the cold phase
  then also runs with it, so that it writes dynamo's cache).

Per phase: the seconds of making the session and of its warm-up, the saved specializations it found and did
not use (with the guard that rejected each: ``rejected``) or could not load (``not_loaded``), dynamo's and
inductor's timers (``torch._dynamo.utils.compile_times``) and the cache counters (FX graph cache,
AOTAutograd cache hits and misses; frames compiled), and what the folder of whole compiled functions (fsd_eagle.precompiled, the
commands' default; ``--no-precompiled``: none) holds: saved files, and the variants that could not be packaged
with why. Random-weight target of the default model's shape with the shipped head (``--random-head``: a
random head of its shape, so that not even the head's weights are needed), so no model files are needed:

    python eval/device/warm_rebuild.py --rows 1 --out $OUT/warm_rebuild.json

The result file is rewritten after every phase.
"""

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PHASES = ("cold", "warm", "graph-first", "precompile")


def counters() -> dict:
    from torch._dynamo.utils import counters as dynamo_counters

    keep = ("inductor", "aot_autograd", "frames", "stats", "graph_break")
    return {k: {str(n): v for n, v in dynamo_counters[k].items()} for k in keep if k in dynamo_counters}


def phase(name: str, rows: int, context: int, precompile: bool, random_head: bool = False) -> dict:
    """One phase in this process (a child of ``main``)."""
    import torch
    import torch._dynamo

    if precompile:
        if not hasattr(torch._dynamo.config, "caching_precompile"):
            return {"phase": name, "skipped": "this torch has no torch._dynamo.config.caching_precompile"}
        torch._dynamo.config.caching_precompile = True
    from eval.device.round_cost import random_generator
    from fsd_eagle import precompiled
    from fsd_eagle.server.compiler import warm
    from torch._dynamo.utils import compile_times

    rejected = Rejections()  # saved specializations this process found and did not use, with why
    precompiled.log.addHandler(rejected)
    precompiled.log.setLevel(logging.DEBUG)

    gen = random_generator(torch.bfloat16, random_head)
    call = gen.prepare(list(range(100, 160)), max_new_tokens=32)
    out: dict = {"phase": name, "rows": rows, "context": context, "precompile": precompile}
    if name == "graph-first":
        start = time.perf_counter()
        warm(gen.session_for(call, rows, compiled=False), call, context)
        torch.cuda.synchronize()
        out["graph_session_s"] = round(time.perf_counter() - start, 2)
    start = time.perf_counter()
    session = gen.session_for(call, rows, compiled=True)
    made = time.perf_counter()
    warm(session, call, context)
    torch.cuda.synchronize()
    end = time.perf_counter()
    out.update(session_s=round(made - start, 2), warm_s=round(end - made, 2), total_s=round(end - start, 2),
               mode=session.mode, compile_times=compile_times(repr="str", aggregate=True), counters=counters(),
               rejected=rejected.messages)
    return out


class Rejections(logging.Handler):
    """Keeps the messages of fsd_eagle.precompiled's debug records (saved specializations that did not fit)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:3000])


def saved_functions(folder: Path) -> dict:
    """What the folder of whole compiled functions holds after a phase: each saved file (its path in the
    folder) and each variant that could not be packaged, with the start of the reason."""
    if not folder.is_dir():
        return {}
    return {"files": sorted(str(p.relative_to(folder)) for p in folder.rglob("*.pt")),
            "unpackable": {str(p.parent.relative_to(folder)): p.read_text()[:1500] for p in folder.rglob("unpackable.txt")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--context", type=int, default=2048, help="cache tokens per row, as a server's lanes")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--cache", default=None, help="compile cache folder (default: a new temporary one)")
    p.add_argument("--no-precompiled", action="store_true",
                   help="keep no whole compiled functions (fsd_eagle.precompiled; by default they go to CACHE/functions)")
    p.add_argument("--random-head", action="store_true",
                   help="a random head of the shipped head's shape (no head weights needed)")
    p.add_argument("--out", required=True)
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        name, precompile = a.child.split(":")
        result = phase(name, a.rows, a.context, precompile == "1", a.random_head)
        Path(a.out).write_text(json.dumps(result, indent=1))
        return 0
    from fsd_eagle.jsonl import write_text_atomic

    cache = Path(a.cache or tempfile.mkdtemp(prefix="warm-rebuild-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PYTHONUNBUFFERED": "1", "FSD_EAGLE_PRECOMPILED": "0" if a.no_precompiled else str(cache / "functions")}
    phases = a.phases.split(",")
    answers = Path(tempfile.mkdtemp(prefix="warm-rebuild-phases-"))  # each phase's result, apart from the cache
    precompile_cold = "precompile" in phases
    result = {"command": "python " + " ".join(sys.argv), "cache": str(cache), "phases": []}
    for name in phases:
        flag = "1" if name == "precompile" or (name == "cold" and precompile_cold) else "0"
        child_out = answers / f"{name}.json"
        start = time.perf_counter()
        child = [sys.executable, __file__, "--rows", str(a.rows), "--context", str(a.context), "--out", str(child_out),
                 "--child", f"{name}:{flag}"] + ["--random-head"] * a.random_head
        run = subprocess.run(child, env=env, capture_output=True, text=True)
        entry = json.loads(child_out.read_text()) if child_out.exists() else {"phase": name}
        entry["process_s"] = round(time.perf_counter() - start, 1)
        if run.returncode:
            entry["error"] = run.stderr[-3000:]
        entry["precompiled"] = saved_functions(cache / "functions")
        lines = [line.strip()[:600] for line in run.stderr.splitlines()]
        entry["not_saved"] = [line for line in lines if "compiled without saving" in line]
        entry["not_loaded"] = [line for line in lines if "this process can load" in line]
        result["phases"].append(entry)
        print(json.dumps({k: v for k, v in entry.items() if k not in ("compile_times", "counters")}), flush=True)
        write_text_atomic(Path(a.out), json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
