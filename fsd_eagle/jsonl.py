"""JSON-lines files (plain or gzip, told apart by their first bytes), read with one-line errors, and the
resumable results file of ``fsd-eagle generate --output``.

Shared by the benchmark loaders (eval/), the trainer's data readers (training/) and the command line.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import IO, Any, Iterator

from .errors import InputError


def open_text(path: Path, what: str) -> IO[str]:
    """Open a UTF-8 text file, gunzipping it when it starts with the gzip magic; InputError if it cannot be."""
    return io.TextIOWrapper(open_binary(path, what), encoding="utf-8")


def parse_object(line: str) -> dict[str, Any]:
    """One line as a JSON object; InputError (one line, without the file's name) otherwise."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(f"not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {json_type(obj)}")
    return obj


def json_type(value) -> str:
    """How an error names a JSON value's type."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


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
                    obj = parse_object(line)
                except InputError as e:
                    raise InputError(f"{path}, line {number}: {e}") from None
                yield number, obj
        except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as e:
            raise InputError(f"{path}: cannot decode {what} file ({e})") from None
    if not seen:
        raise InputError(f"{what} file is empty: {path}")


def open_binary(path: Path, what: str) -> IO[bytes]:
    """Open a file for reading bytes, gunzipping it when it starts with the gzip magic; InputError if it
    cannot be. Bytes, so that a reader can number the lines that are not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
        return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read {what} file {path}: {e.strerror or e}") from None


def id_key(value) -> str:
    """A record id as a set key that keeps JSON types apart (the id 3 is not the id "3")."""
    return json.dumps(value, ensure_ascii=False)


def write_text_atomic(path: Path | str, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file in the same folder and ``os.replace``:
    readers, and a run that resumes from the file, see the old content or the new, never a partial write
    (the temporary file is the process's own: processes writing the same file at once do not collide)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def json_line(obj: dict) -> bytes:
    """One JSON object as a UTF-8 line (non-ASCII kept readable; escaped where the text is not encodable)."""
    try:
        return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return (json.dumps(obj) + "\n").encode("ascii")


class ResultsFile:
    """An append-only JSON-lines file of records with an ``"id"``, written so that a killed run can be
    resumed: every record is one ``write`` of a whole line, then flushed to disk (``os.fsync``), so that the
    file holds complete lines plus, at worst, one torn last line. Opening it

    - takes an exclusive lock (where the OS has ``fcntl``): a second run writing the same file is refused
      instead of interleaving lines;
    - cuts a torn last line (bytes after the last newline: a line always ends with its newline, so these
      are a write that did not finish) away;
    - reads the ids already written (``done``, as ``id_key``s), refusing a file whose lines are not such
      records (the file is then left as it was, torn tail included, since it is not ours).
    """

    def __init__(self, path: Path, what: str = "output"):
        self.path = Path(path)
        self.what = what
        if self.path.exists() and not self.path.is_file():
            raise InputError(f"{what} {self.path} is not a regular file")
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
        except OSError as e:
            raise InputError(f"cannot write {what} file {self.path}: {e.strerror or e}") from None
        try:
            self._lock()
            self.done = self._read_done()
        except BaseException:
            os.close(self.fd)
            raise

    def _lock(self) -> None:
        try:
            import fcntl
        except ImportError:  # no advisory locks on this OS
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"{self.what} file {self.path} is being written by another run") from None

    def _read_done(self) -> set[str]:
        with open(self.fd, "rb", closefd=False) as f:
            f.seek(0)
            data = f.read()
        end = data.rfind(b"\n") + 1
        done = set()
        for number, line in enumerate(data[:end].split(b"\n")[:-1], 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                obj = None
            if not isinstance(obj, dict) or not _is_id(obj.get("id")):
                raise InputError(f"{self.what} file {self.path}, line {number}: not a record with an \"id\" from an "
                                 f"earlier run; pick another {self.what} file")
            done.add(id_key(obj["id"]))
        if end < len(data):
            os.ftruncate(self.fd, end)
            os.fsync(self.fd)
        return done

    def write(self, obj: dict) -> None:
        """Append one record as a line and flush it to disk."""
        data = memoryview(json_line(obj))
        while data:
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_id(value) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)
