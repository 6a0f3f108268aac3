"""Where compiled kernels are kept. ``use_folder``: the commands that compile keep torch.compile's local cache
in the fsd-eagle cache folder (``~/.cache/fsd-eagle/compile``, or ``$FSD_EAGLE_CACHE/compile``) unless
``TORCHINDUCTOR_CACHE_DIR`` names another place, so a restart on the same machine (a server's included)
finds every kernel it compiled before, even after /tmp was cleared.

Compiled rounds that travel between machines: with ``FSD_EAGLE_COMPILE_CACHE=<file>`` set, the first
compiled round or prefill of a process loads the kernels that file holds (``decode._compile``), and every
compiled capture writes the process's kernels back to it (those it loaded included; ``Session``).

torch.compile already keeps its kernels in a local cache (``TORCHINDUCTOR_CACHE_DIR``), so a second process
on the same machine compiles a round in seconds instead of 60-200 s. A fresh machine, container or CI
runner has no such cache; this file is the portable form of it (``torch.compiler.save_cache_artifacts``):
copied to another machine with the same GPU type, torch and transformers versions, it turns the compilation
of each round into a cache hit (dynamo still traces the Python code). A file from another configuration is
harmless: its entries simply never match.

The variable may name several files, separated by ``os.pathsep`` (``:`` on Linux): all of them are loaded
and the first is the one written, so kernels compiled by several processes (each writing its own file) can
serve one later process.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

import torch

ENV = "FSD_EAGLE_COMPILE_CACHE"
_restored: set[Path] = set()


def use_folder(folder: Path) -> Path:
    """Keep inductor's cache (its generated code and compiled kernels) in ``folder``/inductor unless
    ``TORCHINDUCTOR_CACHE_DIR`` is set, and whole compiled rounds and prefills in ``folder``/functions unless
    ``FSD_EAGLE_PRECOMPILED`` is set (fsd_eagle.precompiled); returns inductor's folder. Call before the
    first compilation."""
    from . import precompiled

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(folder / "inductor"))
    precompiled.use_folder(folder / "functions")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def cache_files() -> list[Path]:
    """The files named by ``FSD_EAGLE_COMPILE_CACHE`` (``os.pathsep``-separated; empty names skipped)."""
    names = os.environ.get(ENV, "").split(os.pathsep)
    return [Path(name.strip()).expanduser() for name in names if name.strip()]


def cache_file() -> Path | None:
    """The file that ``store`` writes: the first one named, or None when the variable is unset or empty."""
    files = cache_files()
    return files[0] if files else None


def restore() -> bool:
    """Load the kernels of every file named into torch.compile's caches, once per process and file. Returns
    whether it loaded something. An unreadable file is reported as a warning and skipped (it is only a
    cache)."""
    loaded = False
    for path in cache_files():
        if path not in _restored:
            _restored.add(path)
            loaded = _load(path) or loaded
    return loaded


def _load(path: Path) -> bool:
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
        warnings.warn(f"{ENV}={path}: not a compile cache this torch can read ({problem}); ignored", stacklevel=3)
    return loaded


def store() -> int:
    """Write every kernel this process compiled or loaded to the first file named (atomically: a temporary
    file in the same folder, then a rename). Returns the bytes written (0 when unset or nothing was compiled)."""
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
