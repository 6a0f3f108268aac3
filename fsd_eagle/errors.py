"""Exception types. Every user-facing failure raises a subclass of FSDError with one readable line."""


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
