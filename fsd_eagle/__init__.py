"""fsd-eagle: EAGLE-2 speculative decoding with Fuzzy Speculative Decoding (FSD) on stock transformers models.

The public names are imported on first use (PEP 562), so ``import fsd_eagle`` (and the command line's start)
does not load torch and transformers: a Ctrl-C in the first seconds reaches the command line's handler.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import BusyError, ConfigError, FSDError, HeadMismatchError, InputError, ModelLoadError

_LAZY = {"SpeculativeGenerator": "api", "GenerationResult": "api", "generate": "api", "TreeConfig": "config",
         "SamplingConfig": "config", "FuzzyConfig": "config"}

__all__ = ["SpeculativeGenerator", "GenerationResult", "generate", "TreeConfig", "SamplingConfig", "FuzzyConfig",
           "FSDError", "InputError", "ConfigError", "ModelLoadError", "HeadMismatchError", "BusyError"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .api import GenerationResult, SpeculativeGenerator, generate
    from .config import FuzzyConfig, SamplingConfig, TreeConfig


def __getattr__(name: str):
    """A public name from its module, or a submodule (``fsd_eagle.api``) imported on first access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    elif not name.startswith("__"):
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
