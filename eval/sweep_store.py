"""What a sweep folder holds, shared by the sweep that writes it (eval/sweep.py) and the report that reads it
(eval/report.py): its file names, the decoding settings (``Config``) and the per-question result files
(``ResultStore``)."""

from __future__ import annotations

import gzip
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from fsd_eagle.errors import ConfigError
from fsd_eagle.jsonl import write_text_atomic

TASKS = ("gsm8k", "mmlu", "humaneval", "arith")
SETTINGS_FILE = "settings.json"
RUNS_FILE = "runs.jsonl"

# ---------------------------------------------------------------------------------------------- configs


def threshold_to_json(t: float | None):
    """JSON-safe threshold: None stays None, inf becomes "inf", numbers stay numbers."""
    if t is None:
        return None
    return "inf" if math.isinf(t) else float(t)


def threshold_from_json(v) -> float | None:
    if v is None:
        return None
    if isinstance(v, str):
        if v.strip().lower() in ("inf", "infinity", "+inf"):
            return math.inf
        return float(v)
    return float(v)


def format_threshold(t: float | None) -> str:
    if t is None:
        return "-"
    return "inf" if math.isinf(t) else f"{t:g}"


@dataclass(frozen=True)
class Config:
    """One decoding setting of the sweep."""

    method: str  # "ar", "eagle2" or "fsd"
    divergence: str | None = None
    threshold: float | None = None

    @property
    def key(self) -> str:
        """Folder name and row id: ``ar``, ``eagle2``, ``fsd-kl-0.5``, ``fsd-js-inf``."""
        if self.method == "fsd":
            return f"fsd-{self.divergence}-{format_threshold(self.threshold)}"
        return self.method

    def to_json(self) -> dict:
        return {"method": self.method, "divergence": self.divergence,
                "threshold": threshold_to_json(self.threshold)}


class ResultStore:
    """Per-question JSON lines under ``OUT/raw/<config key>/<task>.jsonl``, appended as jobs complete (a
    shard K of N: ``<task>.K-of-N.jsonl``). Every file of a config and task is read: the shards' and
    archived records compressed as ``<task>.jsonl.gz`` (what ``eval/results/`` keeps), so an archived or
    sharded sweep is reported, and resumed, as one; new records go to this store's own ``.jsonl``."""

    def __init__(self, out: Path | str, shard: tuple[int, int] | None = None) -> None:
        self.out = Path(out)
        self.raw = self.out / "raw"
        self.suffix = ".jsonl" if shard is None else f".{shard[0]}-of-{shard[1]}.jsonl"
        self._files: dict[Path, object] = {}

    def path(self, key: str, task: str) -> Path:
        """The file this store appends to."""
        return self.raw / key / f"{task}{self.suffix}"

    def files(self, key: str, task: str) -> list[Path]:
        """Every record file of a config and task (this store's, other shards', archives)."""
        folder = self.raw / key
        paths = sorted(folder.glob(f"{task}.jsonl*")) + sorted(folder.glob(f"{task}.*-of-*.jsonl*"))
        return [p for p in paths if p.suffix in (".jsonl", ".gz")]

    def read(self, path: Path) -> list[dict]:
        """Records of one file. A line cut off by a kill (no final newline, or not JSON) is dropped; in this
        store's own file it is also removed, so that later appends start on a fresh line (another shard's
        file may be growing while it is read: it is never rewritten here)."""
        if not path.is_file():
            return []
        if path.suffix == ".gz":  # an archive: read only, never rewritten
            with gzip.open(path, "rt", encoding="utf-8") as f:
                return [obj for obj in (json.loads(line) for line in f if line.strip())
                        if isinstance(obj, dict) and "qid" in obj]
        raw = path.read_text(encoding="utf-8")
        records, bad = [], False
        lines = raw.split("\n")
        if lines and lines[-1] != "":  # the last line was not finished
            bad = True
        for line in lines[:-1]:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                bad = True
                continue
            if isinstance(obj, dict) and "qid" in obj:
                records.append(obj)
            else:
                bad = True
        if bad and path.name == path.name.split(".")[0] + self.suffix:  # this store's own file
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
            os.replace(tmp, path)
        return records

    def done(self, key: str, task: str) -> set[str]:
        return {str(r["qid"]) for path in self.files(key, task) for r in self.read(path)}

    def records(self) -> list[dict]:
        """Every stored record, all configs and tasks (one per (config, task, question): the first wins)."""
        out, seen = [], set()
        if not self.raw.is_dir():
            return out
        paths = sorted(self.raw.glob("*/*.jsonl")) + sorted(self.raw.glob("*/*.jsonl.gz"))
        for path in paths:
            task = path.name.split(".")[0]
            for r in self.read(path):
                ident = (path.parent.name, task, str(r["qid"]))
                if ident not in seen:
                    seen.add(ident)
                    out.append(r)
        return out

    def append(self, record: dict) -> None:
        path = self.path(record["config"], record["task"])
        f = self._files.get(path)
        if f is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = self._files[path] = open(path, "a", encoding="utf-8")
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def check_settings(self, settings: dict) -> None:
        """Write OUT/settings.json, or refuse when the folder holds results made with other settings."""
        path = self.out / SETTINGS_FILE
        if path.is_file():
            old = json.loads(path.read_text())
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            if diff:
                shown = ", ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff)
                raise ConfigError(f"{self.out} holds results made with other settings ({shown}); "
                                  f"use another --out or the same settings")
            return
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(settings, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ worker
