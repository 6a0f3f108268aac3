"""The portable compile cache (fsd_eagle.compile_cache, FSD_EAGLE_COMPILE_CACHE): a process that compiled
writes its kernels to the file; a process on a "fresh machine" (an empty local inductor cache) that loads
the file compiles the same function from cache hits, one that does not load it compiles from scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import has_cpu_compiler
from fsd_eagle import compile_cache

ROOT = Path(__file__).resolve().parents[1]

# Compiles a small function that stands in for a round, then stores (or not) and prints inductor's counters.
CHILD = """
import json, sys, torch
from torch._dynamo.utils import counters
from fsd_eagle import compile_cache
loaded = compile_cache.restore() if sys.argv[1] == "restore" else False
def step(x, w):
    return torch.softmax((x @ w).relu() * 0.5, -1).sum(0)
def other(x, w):
    return torch.tanh(x @ w).cumsum(0) * 3
for name in sys.argv[2]:
    torch.compile({"s": step, "o": other}[name])(torch.randn(16, 32), torch.randn(32, 8))
size = compile_cache.store()
print(json.dumps({"loaded": loaded, "stored": size, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def _child(tmp_path: Path, local_cache: str, mode: str, env_file: Path | str | None, functions: str = "s") -> dict:
    """A process on a machine of its own (``local_cache``) that compiles ``functions`` ("s": step, "o":
    other), with FSD_EAGLE_COMPILE_CACHE = ``env_file``; ``mode`` "restore" loads it first."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / local_cache),
           "OMP_NUM_THREADS": "1"}
    env.pop(compile_cache.ENV, None)
    if env_file is not None:
        env[compile_cache.ENV] = str(env_file)
    done = subprocess.run([sys.executable, "-c", CHILD, mode, functions], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not has_cpu_compiler(), reason="torch.compile on the CPU needs g++ and Python headers")
def test_a_fresh_machine_that_loads_the_files_compiles_from_cache_hits(tmp_path):
    """Machine a compiles ``step`` and writes one.bin; machine b, without a file to load, compiles ``other``
    from scratch and writes two.bin; machine c names both files, compiles both functions from cache hits
    alone and writes the first file, which then holds both."""
    one, two = tmp_path / "out" / "one.bin", tmp_path / "out" / "two.bin"
    first = _child(tmp_path, "machine_a", "restore", one, "s")
    assert first["loaded"] is False and first["misses"] >= 1 and first["hits"] == 0
    assert first["stored"] == one.stat().st_size > 0
    assert not list(one.parent.glob(".*.tmp"))  # written through a temporary file, then renamed
    cold = _child(tmp_path, "machine_b", "none", two, "o")  # nothing loaded: compiles from scratch
    assert cold["hits"] == 0 and cold["misses"] >= 1 and cold["stored"] == two.stat().st_size > 0
    warm = _child(tmp_path, "machine_c", "restore", f"{one}{os.pathsep}{two}", "so")
    assert warm["loaded"] is True and warm["hits"] >= 2 and warm["misses"] == 0
    assert warm["stored"] == one.stat().st_size > first["stored"]  # one.bin now holds both functions


def test_unset_does_nothing_and_a_broken_file_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.delenv(compile_cache.ENV, raising=False)
    assert compile_cache.cache_file() is None and compile_cache.restore() is False and compile_cache.store() == 0
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "missing.bin"))
    assert compile_cache.restore() is False  # nothing to load yet
    broken = tmp_path / "broken.bin"
    broken.write_bytes(b"not a cache")
    monkeypatch.setenv(compile_cache.ENV, str(broken))
    with pytest.warns(UserWarning, match="not a compile cache"):
        assert compile_cache.restore() is False
    assert compile_cache.restore() is False  # once per process and file: no second warning


def test_every_compiled_function_loads_the_file_first(monkeypatch):
    """decode._compile (behind compiled rounds and prefills) loads FSD_EAGLE_COMPILE_CACHE before compiling."""
    from fsd_eagle import decode

    calls = []
    monkeypatch.setattr(compile_cache, "restore", lambda: calls.append("restore") or False)
    decode._compile(lambda x: x + 1)
    decode._compile(lambda x: x * 2, dynamic=True)
    assert calls == ["restore", "restore"]
