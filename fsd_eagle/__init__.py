"""fsd-eagle: EAGLE-2 speculative decoding with Fuzzy Speculative Decoding (FSD) on stock transformers models."""

from .api import GenerationResult, SpeculativeGenerator, generate
from .config import FuzzyConfig, SamplingConfig, TreeConfig
from .errors import ConfigError, FSDError, HeadMismatchError, InputError, ModelLoadError

__all__ = ["SpeculativeGenerator", "GenerationResult", "generate", "TreeConfig", "SamplingConfig", "FuzzyConfig",
           "FSDError", "InputError", "ConfigError", "ModelLoadError", "HeadMismatchError"]
__version__ = "0.1.0"
