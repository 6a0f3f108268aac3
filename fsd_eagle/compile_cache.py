"""Compiled rounds that travel between machines: with ``FSD_EAGLE_COMPILE_CACHE=<file>`` set, the first
compiled round or prefill of a process loads the kernels that file holds (``decode._compile``), and every
compiled capture writes the process's kernels back to it (those it loaded included; ``Session``).

torch.compile already keeps its kernels in a local cache (``TORCHINDUCTOR_CACHE_DIR``), so a second process
on the same machine compiles a round in seconds instead of 60-200 s. A fresh machine, container or CI
runner has no such cache; this file is the portable form of it (``torch.compiler.save_cache_artifacts``):
copied to another machine with the same GPU type, torch and transformers versions, it turns the compilation
of each round into a cache hit (dynamo still traces the Python code). A file from another configuration is
harmless: its entries simply never match.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

ENV = "FSD_EAGLE_COMPILE_CACHE"
_restored: set[Path] = set()


def cache_file() -> Path | None:
    """The file named by ``FSD_EAGLE_COMPILE_CACHE``, or None when it is unset or empty."""
    name = os.environ.get(ENV, "").strip()
    return Path(name).expanduser() if name else None


def restore() -> bool:
    """Load the file's kernels into torch.compile's caches, once per process and file. Returns whether it
    loaded something. An unreadable file is reported as a warning and skipped (it is only a cache)."""
    path = cache_file()
    if path is None or path in _restored:
        return False
    _restored.add(path)
    if not path.is_file():
        return False
    quiet = logging.getLogger("torch.compiler._cache")  # its own multi-line report of a corrupted file
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        loaded = torch.compiler.load_cache_artifacts(path.read_bytes()) is not None
        problem = "" if loaded else "unreadable"  # torch logs a corrupted file and returns None
    except (OSError, RuntimeError, ValueError, EOFError) as e:  # a truncated or foreign file
        loaded, problem = False, type(e).__name__
    finally:
        quiet.setLevel(level)
    if problem:
        warnings.warn(f"{ENV}={path}: not a compile cache this torch can read ({problem}); ignored", stacklevel=2)
    return loaded


def store() -> int:
    """Write every kernel this process compiled or loaded to the file (atomically: a temporary file in the
    same folder, then a rename). Returns the bytes written (0 when unset or nothing was compiled)."""
    path = cache_file()
    if path is None:
        return 0
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return 0
    data = saved[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)
