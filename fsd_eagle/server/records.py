"""The configurations a server moved to compiled rounds, recorded so that a restart builds them before it answers.

A compiled configuration (a rule form on a batch bucket) is made in two steps: the compiling process
compiles it and saves its compiled round and prefills whole (fsd_eagle.precompiled), then the engine
thread makes the session from those saved functions. On a restart the first step is not needed: the
functions are on disk. What the new process does not know is which configurations its clients will ask
for. So each configuration the engine takes over is recorded here (one small file: its batch rows and
a call of its form), and the next server on the same model, context, versions and device builds the
recorded ones from saved functions alone (``precompiled.loads_only``: never compiling on the engine
thread) before ``/health`` says ready, and the rest when a lane of theirs opens.

The records live beside the saved functions they point to: ``<precompiled folder>/<environment>/server/
<model digest>/<configuration digest>.json``, where the model digest covers the load options (target,
head, draft model, device, dtype, attention) and the context size. A recorded call holds no user text:
its prompt is a neutral one (token 0 repeated) and its stop strings are dropped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

from .. import precompiled
from ..api import PreparedCall
from ..decode import DecodeStats
from .compiler import pack, unpack

FOLDER = "server"
NEUTRAL_PROMPT_TOKENS = 8  # the length of a recorded call's prompt (warm-ups cut and repeat it)


@dataclasses.dataclass
class Record:
    """One recorded configuration: a call of its form (neutral prompt) and the batch rows of its session."""

    call: PreparedCall
    rows: int
    path: Path


def folder_for(options: dict, context: int) -> Path | None:
    """Where a server loaded with ``options`` (``SpeculativeGenerator.load``'s arguments and ``attention``)
    and caches of ``context`` tokens per row keeps its records; None where no folder of saved compiled
    functions is set (then a restart has nothing to build from)."""
    base = precompiled.folder()
    if base is None:
        return None
    model = sorted((name, str(value)) for name, value in options.items() if name != "threads")
    return base / precompiled.environment() / FOLDER / precompiled.describe(model, context)


def record(where: Path, call: PreparedCall, rows: int, key: tuple) -> Path:
    """Record ``call``'s configuration (``key``) on ``rows`` rows in ``where``, written atomically; a
    configuration recorded again is rewritten (the newest record is built first on the next start)."""
    neutral = dataclasses.replace(call, prompt_ids=torch.zeros(NEUTRAL_PROMPT_TOKENS, dtype=torch.long), stop=(),
                                  seed=0, stats=DecodeStats(), clipped=False)
    text = json.dumps({"rows": rows, "call": pack(neutral)})
    return precompiled.write_atomically(where / f"{precompiled.describe(key)}.json", text.encode())


def recorded(where: Path | None) -> list[Record]:
    """The configurations recorded in ``where``, the most recently recorded first. A record that cannot be
    read (a foreign or truncated file) is skipped with one line on stderr."""
    if where is None or not where.is_dir():
        return []
    found = []
    for path in sorted(where.glob("*.json"), key=_modified, reverse=True):
        try:
            data = json.loads(path.read_text())
            call = unpack(data["call"])
            if not isinstance(call, PreparedCall):
                raise TypeError(f"not a prepared call: {type(call).__name__}")
            found.append(Record(call, int(data["rows"]), path))
        except Exception as e:  # noqa: BLE001 - a damaged record is only a lost head start
            print(f"fsd-eagle: {path}: not a configuration record ({type(e).__name__}: {e}); skipped",
                  file=sys.stderr)
    return found


def _modified(path: Path) -> float:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0
