"""JSON-lines files (plain or gzip, told apart by their first bytes), read with one-line errors.

Shared by the benchmark loaders (eval/) and the trainer's data readers (training/).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import IO, Any, Iterator

from .errors import InputError


def open_text(path: Path, what: str) -> IO[str]:
    """Open a text file, gunzipping it when it starts with the gzip magic; InputError if it cannot be."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        if magic == b"\x1f\x8b":
            return gzip.open(path, "rt", encoding="utf-8")
        return open(path, encoding="utf-8")
    except OSError as e:
        raise InputError(f"cannot read {what} file {path}: {e.strerror or e}") from None


def read_json_lines(path: Path, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)`` for the non-blank lines; InputError on a missing, unreadable or
    empty file and on a line that is not a JSON object."""
    path = Path(path)
    seen = False
    with open_text(path, what) as f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                seen = True
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InputError(f"{path}, line {number}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise InputError(f"{path}, line {number}: expected a JSON object, got {type(obj).__name__}")
                yield number, obj
        except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
            raise InputError(f"{path}: cannot decode {what} file ({e})") from None
    if not seen:
        raise InputError(f"{what} file is empty: {path}")
