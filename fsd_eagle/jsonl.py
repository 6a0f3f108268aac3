"""JSON-lines files (plain or gzip, told apart by their first bytes), read with one-line errors, and the
resumable results file of ``fsd-eagle generate --output``.

Shared by the benchmark loaders (eval/), the trainer's data readers (training/) and the command line.
"""

from __future__ import annotations

import gzip
import hashlib
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
    cannot be. Bytes, so that a reader can number the lines that are not UTF-8. A pipe (``<(...)``, a FIFO)
    is read once, its first bytes peeked at rather than reopened."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{what} file {path} is a folder, not a file")
    if not path.exists():
        raise InputError(f"{what} file not found: {path}")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"cannot read {what} file {path}: {e.strerror or e}") from None
    magic = f.peek(2)[:2] if isinstance(f, io.BufferedReader) else b""
    if magic != b"\x1f\x8b":
        return f
    if path.is_file():  # reopened by name, so that closing the reader closes the file
        f.close()
        return gzip.open(path, "rb")
    return gzip.GzipFile(fileobj=f, mode="rb")  # a pipe is read once, from the bytes already peeked at


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


RESULTS_FORMAT = "fsd-eagle generate results"  # the header line's "format": what proves a results file ours


def fingerprint_digest(obj) -> str:
    """sha256 of ``obj`` as canonical JSON (sorted keys): how a results file names its input and prompts."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


class ResultsFile:
    """An append-only JSON-lines file of results, written so that a killed run can be resumed, and only over
    a file that is provably its own. Its first line is a header ``{"format": RESULTS_FORMAT, "fingerprint":
    {...}}``: what the run reads (a digest of its prompts), its settings, and its model and drafter; every
    further line is a record with an ``"id"`` and the ``"prompt_sha256"`` of the prompt it answers. Every
    record is one ``write`` of a whole line, then flushed to disk (``os.fsync``), so that the file holds
    complete lines plus, at worst, one torn last line. Opening it

    - takes an exclusive lock (where the OS has ``fcntl``): a second run writing the same file is refused
      instead of interleaving lines;
    - on a missing or empty file, writes the header;
    - refuses, changing nothing, a file whose first line is not such a header (not ours), whose records are
      not such records, or whose fingerprint differs from this run's (another input, settings or model),
      unless ``overwrite``: then a file of ours starts afresh;
    - cuts a torn last line of a file of ours (bytes after the last newline: a write that did not finish);
    - reads the results already written (``done``: ``(id_key(id), prompt_sha256)`` pairs).
    """

    def __init__(self, path: Path, fingerprint: dict, what: str = "output", overwrite: bool = False):
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
            self.done = self._open(fingerprint, overwrite)
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

    def _open(self, fingerprint: dict, overwrite: bool) -> set[tuple[str, str]]:
        with open(self.fd, "rb", closefd=False) as f:
            f.seek(0)
            data = f.read()
        header = {"format": RESULTS_FORMAT, "fingerprint": fingerprint}
        if not data:
            self.write(header)
            return set()
        first = data.split(b"\n", 1)[0] if b"\n" in data else b""
        found = _json_object(first)
        if found is None or found.get("format") != RESULTS_FORMAT or not isinstance(found.get("fingerprint"), dict):
            raise InputError(f"{self.what} file {self.path} was not written by fsd-eagle generate (its first line is "
                             f"no results header), so it is left as it is: pick another {self.what} file")
        if found["fingerprint"] != fingerprint:
            if not overwrite:
                raise InputError(f"{self.what} file {self.path} holds the results of another run (other "
                                 f"{_difference(found['fingerprint'], fingerprint)}): pick another {self.what} file, "
                                 "or --overwrite to start it afresh")
            os.ftruncate(self.fd, 0)
            self.write(header)
            return set()
        end = data.rfind(b"\n") + 1
        done = set()
        for number, line in enumerate(data[len(first) + 1:end].split(b"\n")[:-1], 2):
            if not line.strip():
                continue
            obj = _json_object(line)
            if obj is None or not _is_id(obj.get("id")) or not isinstance(obj.get("prompt_sha256"), str):
                raise InputError(f"{self.what} file {self.path}, line {number}: not a result record (an \"id\" and a "
                                 f"\"prompt_sha256\"); the file is left as it is: pick another {self.what} file")
            done.add((id_key(obj["id"]), obj["prompt_sha256"]))
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


def _json_object(line: bytes) -> dict | None:
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _difference(old: dict, new: dict) -> str:
    """Which parts of two fingerprints differ, in words: "input", "settings (temperature)", "model"."""
    parts = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            parts.append(f"{key} ({', '.join(fields)})")
        else:
            parts.append(key)
    return ", ".join(parts) or "fingerprint"


def _is_id(value) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)
