"""Compiled rounds and prefills kept on disk whole, so that a new process (a restart, a server taking a
configuration over from its compiling process) runs them without tracing or compiling anything.

torch.compile's caches keep inductor's kernels, but a new process still has dynamo trace the Python code
of every round and prefill again (about 20 s per configuration of the default model on an H100, before
any kernel is looked up). ``torch.compile(...).aot_compile`` (torch >= 2.11) packages everything at once:
dynamo's transformed bytecode, its guards and inductor's compiled code; loading one back is a file read.

A ``Precompiled`` function behaves like ``torch.compile(fn, fullgraph=True)``: each call runs the first of
its compiled specializations whose guards accept the arguments (those loaded, then any file that another
process has written into the folder since), and arguments that none accepts compile a new one, which is
written to the folder at once (atomically) for later processes; under ``loads_only`` they raise ``NotSaved``
instead. What is kept of dynamo's guards is what can be saved: tensor dtypes, devices, shapes and strides,
the values of plain attributes (tree sizes, rule forms, the attention backend a model is set to),
symbolic-shape conditions. Identity guards on Python objects (a function, a class, a module global) cannot
be saved and are left out, so the folder of a specialization is keyed by everything they stood for: the
torch, transformers and Python versions, the device (GPU name and capability), this package's source and
the function's own ``variant`` (set by its caller, e.g. the round's batch mode and tree attention).

Used where a folder is set (``FSD_EAGLE_PRECOMPILED``; the commands and the server set it beside
inductor's cache, ``compile_cache.use_folder``) and this torch can save compiled functions. Else, and
when a function cannot be packaged (a graph break, an object that cannot be saved), compilation is the
usual lazy ``torch.compile``, with one warning per function that names the reason. Off with inductor's
freezing (the weights would be constants of the saved code) and in tensor-parallel processes.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import platform
import warnings
from pathlib import Path
from typing import Callable

import torch

#: The folder of saved compiled functions (inherited by child processes, such as a server's compiling
#: process); unset or "0": none (functions compile lazily in each process, as torch.compile does).
ENV = "FSD_EAGLE_PRECOMPILED"
UNPACKABLE = "unpackable.txt"  # beside a variant's files: why its function could not be packaged
#: Debug records of saved specializations that a call's arguments did not fit (with the guard that failed):
#: why a process compiles again what an earlier one saved.
log = logging.getLogger(__name__)
#: Set by ``loads_only``: a call that finds no saved specialization raises ``NotSaved`` instead of compiling.
_LOADS_ONLY = contextvars.ContextVar("fsd_eagle_precompiled_loads_only", default=False)


class NotSaved(Exception):
    """Under ``loads_only``: a compiled function had no saved specialization for its arguments. Not a
    RuntimeError on purpose: graph capture takes a RuntimeError for "this function does not capture" and
    tries the next candidate (an uncompiled round), which would make a compiled session silently a graph one."""


@contextlib.contextmanager
def loads_only():
    """Within it, compiled functions run only what they can load from the folder: a call that would compile
    (nothing saved fits its arguments, no folder is set, or the function cannot be packaged) raises
    ``NotSaved``. For building a configuration on a thread that must not stall for minutes (a server's
    engine thread on a restart): a failure there sends the configuration to a process that may compile."""
    token = _LOADS_ONLY.set(True)
    try:
        yield
    finally:
        _LOADS_ONLY.reset(token)


def refuse(name: str, why: str) -> None:
    """Under ``loads_only``: raise NotSaved for the function ``name``, which would compile (``why``)."""
    if _LOADS_ONLY.get():
        raise NotSaved(f"{name}: {why}")


def use_folder(folder: Path) -> Path:
    """Keep compiled functions in ``folder`` unless ``FSD_EAGLE_PRECOMPILED`` names another place (or "0":
    none); returns the variable's value."""
    return Path(os.environ.setdefault(ENV, str(folder)))


def folder() -> Path | None:
    """Where compiled functions are kept now: None when ``FSD_EAGLE_PRECOMPILED`` is unset or "0", or when
    this torch cannot save them."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "0") or not supported():
        return None
    return Path(value).expanduser()


def supported() -> bool:
    """Whether this torch can package a compiled function (``aot_compile``) and load it back."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return False
    try:
        if hasattr(torch._dynamo.config, "enable_aot_compile"):  # torch 2.11: behind a flag
            torch._dynamo.config.enable_aot_compile = True
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.cache
def _sources_digest() -> str:
    """The sha256 of this package's Python sources (any change to the traced code makes new folders)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment() -> str:
    """What saved code depends on beyond what its guards check: versions, device and this package's code.
    A short digest: the name of a folder."""
    import transformers

    device = "cpu"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device = f"{props.name}:{props.major}.{props.minor}"
    parts = (torch.__version__, transformers.__version__, platform.python_version(), platform.machine(), device,
             _sources_digest())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def serializable_guards(entries) -> list[bool]:
    """The guard filter of a packaged function: keep the guards that can be saved and checked in another
    process. Left out: dynamo's own list of those that cannot be saved (identity, closure, module and
    dictionary-version guards), guards on module globals and on what an import names (resolved in the
    loading process against other objects), on objects of classes defined inside functions, and on what a
    function's closure holds (a loaded function's cells are not the original's: e.g. the function wrappers
    that the ``kernels`` package puts into transformers' attention layers)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    return [not (e.is_global or e.guard_type in unsupported or unsupported.intersection(e.derived_guard_types)
                 or (e.has_value and _local_class(e.value)) or "__closure__" in e.name or "__import__(" in e.name)
            for e in entries]


def _local_class(value) -> bool:
    """Whether ``value`` is an object of a class defined inside a function (such classes cannot be saved:
    e.g. the function wrappers that the ``kernels`` package puts into transformers' attention layers)."""
    cls = value if isinstance(value, type) else type(value)
    return "<locals>" in getattr(cls, "__qualname__", "")


class Precompiled:
    """``fn`` compiled by dynamo and inductor (``fullgraph``), each specialization kept as a file under
    ``folder() / environment() / name / variant_of(*args)``. ``dynamic``: as torch.compile's (False: static
    shapes; None: symbolic exactly where the caller marks dimensions). Call it like ``fn``.

    ``fallback``: the lazily compiled function (``torch.compile(fn, ...)``) used when no folder is set or
    this function cannot be packaged."""

    def __init__(self, fn: Callable, name: str, dynamic: bool | None, fallback: Callable,
                 variant_of: Callable[..., str]) -> None:
        self.fn, self.name, self.dynamic, self.fallback, self.variant_of = fn, name, dynamic, fallback, variant_of
        # folder of a variant -> its specializations by file (loaded functions; None: a file that cannot be read)
        self.loaded: dict[Path, dict[Path, object]] = {}
        self.unpackable: set[Path] = set()  # variants that could not be packaged: compiled lazily

    def __call__(self, *args):
        base = folder()
        if base is None:
            refuse(self.name, "no folder of saved compiled functions is set")
            return self.fallback(*args)
        where = base / environment() / self.name / self.variant_of(*args)
        if where in self.unpackable:
            refuse(self.name, f"cannot be packaged ({where / UNPACKABLE})")
            return self.fallback(*args)
        with hidden_marks(args):  # a loaded function's guards reject marked tensors (see hidden_marks)
            found = self._find(where, args)
            if found is not None:
                return found(*args)
        refuse(self.name, f"nothing saved in {where} fits these arguments")
        found = self._compile(where, args)  # with the marks: they make the compiled dimensions symbolic
        return self.fallback(*args) if found is None else found(*args)

    def _find(self, where: Path, args: tuple):
        """The first specialization in ``where`` whose guards accept ``args``: among those loaded already, else
        among the files written there since (by another process, e.g. a server's compiling process that has
        compiled this function for another batch size since this process last looked), which are loaded now."""
        known = self.loaded.setdefault(where, {})
        for compiled in known.values():
            if compiled is not None and compiled.guard_check(*args):
                return compiled
        for path in sorted(where.glob("*.pt")):
            if path not in known:
                known[path] = compiled = load(path, self.fn.__globals__)  # None: unreadable, not tried again
                if compiled is not None and compiled.guard_check(*args):
                    return compiled
        found = [compiled for compiled in known.values() if compiled is not None]
        if found and log.isEnabledFor(logging.DEBUG):
            for index, compiled in enumerate(found):
                log.debug("%s: saved specialization %d of %d in %s does not fit: %s", self.name, index + 1,
                          len(found), where, rejection(compiled, args))
        return None

    def _compile(self, where: Path, args: tuple):
        """A new specialization, saved; None (lazy compilation of this variant from then on) where it cannot be
        packaged: the reason is kept beside the variant's files (``UNPACKABLE``), so that later processes with
        the same code skip the attempt (a failed capture costs as long as a trace)."""
        marker = where / UNPACKABLE
        if marker.is_file():
            self.unpackable.add(where)
            return None
        try:
            compiled = torch.compile(self.fn, fullgraph=True, dynamic=self.dynamic,
                                     options={"guard_filter_fn": serializable_guards}).aot_compile((args, {}))
            data = type(compiled).serialize(compiled).serialized_data
        except Exception as e:  # noqa: BLE001 - any failure to package: compile lazily as before
            self.unpackable.add(where)
            warnings.warn(f"{self.name}: compiled without saving it ({summary(e)}; {marker})", stacklevel=3)
            write_atomically(marker, f"{type(e).__name__}: {e}\n".encode())
            return None
        self.loaded.setdefault(where, {})[save(where, data)] = compiled
        return compiled


def rejection(compiled, args: tuple) -> str:
    """Why ``compiled`` (a loaded specialization whose ``guard_check`` rejects ``args``) does not fit them: a
    checked call raises before running anything, with the failing guard in its message."""
    try:
        compiled(*args)
    except RuntimeError as e:
        return str(e).strip().replace("\n", " ")[:2000]
    return "its guards accept the arguments now"


def summary(error: Exception) -> str:
    """One line for an error: its type and first line, and where in the user's code it arose when the message
    says (dynamo's messages end with the traced frames: the innermost is the cause)."""
    lines = str(error).strip().splitlines()
    frames = [line.strip() for line in lines if line.strip().startswith('File "')]
    head = f"{type(error).__name__}: {lines[0].strip() if lines else ''}"
    return f"{head} at {frames[-1]}" if frames else head


MARKS = ("_dynamo", "_has_dynamo")  # the prefixes of the attributes torch._dynamo's mark functions set


@contextlib.contextmanager
def hidden_marks(args: tuple):
    """Within: the tensors among ``args`` and those their objects hold (``batch_tensors()``, as
    ``decode.mark_batch_dynamic`` marks them) carry no dynamic-dimension marks. A function that was compiled
    with marked dimensions keeps them symbolic after saving, but its loaded guards no longer know that its
    inputs were marked and reject a marked tensor (torch 2.11-2.13), while they accept the same tensor
    unmarked at any size of those dimensions. The marks are put back on exit."""
    tensors = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            tensors.append(arg)
        elif hasattr(arg, "batch_tensors"):
            tensors.extend(t for t, _ in arg.batch_tensors())
    removed = []
    for tensor in {id(t): t for t in tensors}.values():
        for name in [n for n in tensor.__dict__ if n.startswith(MARKS)]:
            removed.append((tensor, name, tensor.__dict__.pop(name)))
    try:
        yield
    finally:
        for tensor, name, value in removed:
            setattr(tensor, name, value)


def save(where: Path, data: bytes) -> Path:
    """Write one specialization into ``where``, named by the digest of its bytes (two processes that compile
    the same thing write the same file)."""
    return write_atomically(where / f"{hashlib.sha256(data).hexdigest()[:20]}.pt", data)


def write_atomically(path: Path, data: bytes) -> Path:
    """``data`` to ``path`` through a temporary file in the same folder and a rename: a reader sees the
    whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def load(path: Path, f_globals: dict | None = None):
    """A saved specialization (its bytecode reading ``f_globals``: the globals of the module that defined the
    function), or None with a warning when it cannot be read back: a truncated or foreign file is only a
    cache entry, compiled again."""
    try:
        with open(path, "rb") as f, _guard_sink():
            return torch.compiler.load_compiled_function(f, f_globals=f_globals)
    except Exception as e:  # noqa: BLE001 - unreadable cache entry
        warnings.warn(f"{path}: not a compiled function this process can load ({summary(e)}); "
                      "it compiles again", stacklevel=2)
        return None


def _guard_sink():
    """A throwaway tracing context to load a function in. Its saved guard state can name a source that
    installs a guard as it is rebuilt (dynamo's import source: in every function that calls FlexAttention,
    whose arguments dynamo flattens with pytree and so guards on the order of pytree's node registry),
    which outside a trace raises "TracingContext.get() must be called within an ongoing trace" (torch 2.11
    to 2.13). What it installs there is dropped: the loaded function's guards are those saved with it."""
    from torch._guards import TracingContext, tracing

    return tracing(TracingContext(None))


def describe(*values) -> str:
    """A folder name for a variant: the digest of the values' reprs (dataclasses, strings, numbers)."""
    return hashlib.sha256(repr(values).encode()).hexdigest()[:16]


__all__ = ["ENV", "NotSaved", "Precompiled", "describe", "environment", "folder", "load", "loads_only", "refuse", "save",
           "serializable_guards", "supported", "use_folder"]
