"""The engine: what every generation shares and nothing changes once loaded (the target's and the
drafter's weights, the tokenizer and its end-of-sequence ids). Sessions (fsd_eagle.session) bind the
engine's models to caches of their own."""

from __future__ import annotations

from . import parallel
from .drafter import EagleDrafter, ModelDrafter, SlotDrafter
from .errors import ConfigError, HeadMismatchError
from .head import EagleHead, check_fit
from .target import Target


class Engine:
    """A target model, its tokenizer and an optional drafter's weights: an EAGLE ``head`` or a small
    ``draft_model`` sharing the target's tokenizer. ``target`` describes the target (vocabulary, context,
    device, config) for checks and tools; sessions make their own Targets over the same weights. Attributes
    are fixed at construction (assigning one raises AttributeError).

    For a tensor-parallel target (fsd_eagle.parallel), a head reads a replicated copy of the embedding table
    (``draft_embed``), made here once for every session."""

    __slots__ = ("model", "tokenizer", "head", "draft_model", "target", "eos_ids", "draft_embed")

    def __init__(self, model, tokenizer, head: EagleHead | None = None, draft_model=None) -> None:
        if head is not None and draft_model is not None:
            raise ConfigError("use either a draft head or a draft model, not both")
        draft_embed = parallel.drafting_embedding(model) if head is not None else model.get_input_embeddings()
        target = Target(model, draft_embed)
        if head is not None:
            check_fit(head.config, target.config)
        if draft_model is not None and draft_model.get_output_embeddings().weight.shape[0] != target.vocab_size:
            raise HeadMismatchError("the draft model's vocabulary differs from the target's")
        eos = getattr(tokenizer, "eos_token_id", None)
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {i for x in (eos, gen_eos) for i in (x if isinstance(x, (list, tuple)) else [x]) if i is not None}
        values = (model, tokenizer, head, draft_model, target, frozenset(ids), draft_embed)
        for name, value in zip(self.__slots__, values):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"an Engine is immutable (tried to set {name!r})")

    @property
    def has_drafter(self) -> bool:
        return self.head is not None or self.draft_model is not None

    def new_target(self) -> Target:
        """The target model bound to a cache of its own (allocated by the caller)."""
        return Target(self.model, self.draft_embed)

    def new_drafter(self, target: Target) -> SlotDrafter | None:
        """A drafter with a cache of its own, over ``target`` (None without a drafter)."""
        if self.head is not None:
            return EagleDrafter(self.head, target)
        if self.draft_model is not None:
            return ModelDrafter(Target(self.draft_model))
        return None
