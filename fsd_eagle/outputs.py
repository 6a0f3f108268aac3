"""What a command may replace or clear: only folders it wrote itself, and never one that holds its inputs.

Every folder that a command of ours writes whole (a training run, an exported head) holds the file
``MARK``; ``--overwrite`` / ``--force`` replace or clear a non-empty folder only where that file (or, for
folders of earlier versions, a file that only our commands write: ``legacy``) proves it ours, and never a
folder that is, or holds, an input of the command (its data, target, source head, recipe). Refusals are
one-line InputErrors, raised before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable

from .errors import InputError
from .jsonl import write_text_atomic

MARK = ".fsd-eagle"


def within(path: Path | str, folder: Path | str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (links resolved)."""
    p, f = Path(path).resolve(), Path(folder).resolve()
    return p == f or f in p.parents


def mark_ours(folder: Path, kind: str) -> None:
    """Write ``folder``'s MARK: a command of ours (``kind``) wrote this folder."""
    write_text_atomic(folder / MARK, json.dumps({"written_by": "fsd-eagle", "kind": kind}) + "\n")


def is_ours(folder: Path, legacy: Iterable[str] = ()) -> bool:
    return (folder / MARK).is_file() or any((folder / name).is_file() for name in legacy)


def check_replaceable(out: Path, inputs: Iterable[Path | str | None], flag: str, legacy: Iterable[str] = ()) -> None:
    """InputError unless ``out`` may be replaced or cleared with ``flag``: it is missing or empty, or a folder
    of ours (``is_ours``) that holds none of ``inputs`` (None entries are skipped)."""
    out = Path(out)
    for item in inputs:
        if item is not None and str(item) and Path(item).exists() and within(item, out):
            raise InputError(f"{flag} would remove {item}, an input of this command, which lies in {out}: "
                             "choose another --out")
    if out.is_dir() and any(out.iterdir()) and not is_ours(out, legacy):
        raise InputError(f"{flag}: {out} was not written by fsd-eagle (it has no {MARK} file), so it is left as it "
                         "is: choose another --out, or empty it yourself")


def clear_folder(out: Path, inputs: Iterable[Path | str | None], flag: str, legacy: Iterable[str] = ()) -> None:
    """Remove ``out`` (a folder of ours holding no input, see ``check_replaceable``), if it exists."""
    inputs = list(inputs)
    check_replaceable(out, inputs, flag, legacy)
    if out.is_dir():
        shutil.rmtree(out)
