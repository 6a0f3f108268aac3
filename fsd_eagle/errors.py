"""Exception types. Every user-facing failure raises a subclass of FSDError with one readable line."""

import re
import sys


class FSDError(Exception):
    """Base class of every error fsd-eagle raises on purpose."""


class InputError(FSDError, ValueError):
    """A prompt, a generation argument or a data file is not usable."""


class ConfigError(FSDError, ValueError):
    """A configuration value (tree, sampling, fuzzy rule, device, dtype) is invalid."""


class ModelLoadError(FSDError):
    """A target model, draft head or draft model cannot be found or read."""


class HeadMismatchError(ModelLoadError):
    """A draft head (or draft model) does not fit its target: hidden size or vocabulary differ."""


class BusyError(FSDError, RuntimeError):
    """A generator is asked for a second call while its own thread still runs one (an unfinished stream)."""


#: Exit status of the command lines when the device ran out of memory (2: bad input, 130: interrupted).
OUT_OF_MEMORY_STATUS = 3


#: torch's CPU allocator failing (a RuntimeError, not torch.OutOfMemoryError): the part of its message that says so
CPU_ALLOCATOR_FAILURE = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)[^.]*\.?"
                                   r"(?: you tried to allocate \d+ bytes)?")


def out_of_memory_line(error: BaseException, advice: str) -> str | None:
    """One line for ``error`` if it is an out-of-memory error (None otherwise): torch's OutOfMemoryError
    (what ran out, from the first sentences of its message, without its list of every process on the
    device), torch's CPU allocator failing, or Python's MemoryError; then ``advice``. torch is not
    imported here: an error raised before torch was loaded is not torch's."""
    import sys

    if isinstance(error, MemoryError):
        return f"out of memory (the process could not allocate {str(error) or 'more'}): {advice}"
    text = " ".join(str(error).split())
    cpu = CPU_ALLOCATOR_FAILURE.search(text) if isinstance(error, RuntimeError) else None
    if cpu is not None:
        return f"out of memory ({cpu.group(0).rstrip('.')}): {advice}"
    torch = sys.modules.get("torch")
    kind = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if kind is None or not isinstance(error, kind):
        return None
    end = text.find(" is free.")
    what = text[:end + len(" is free")] if end >= 0 else text.split(". ")[0].rstrip(".")
    return f"out of device memory ({what}): {advice}"


def exit_out_of_memory(error: RuntimeError | MemoryError, advice: str, report: bool = True) -> int:
    """For a command line's handler: print ``error: <out_of_memory_line>`` (where this process ``report``s)
    and return OUT_OF_MEMORY_STATUS if ``error`` is torch's out-of-memory error; raise it again otherwise."""
    line = out_of_memory_line(error, advice)
    if line is None:
        raise error
    if report:
        print(f"error: {line}", file=sys.stderr)
    return OUT_OF_MEMORY_STATUS
