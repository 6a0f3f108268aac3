"""Drafters: what proposes the tree. ``EagleDrafter`` runs an EAGLE head on the target's features;
``ModelDrafter`` runs a separate small causal LM that shares the target's tokenizer (classic speculative
decoding; with top_k = 1 its tree is a chain of gamma = depth tokens).

Both keep their own slot KV cache for B batch rows: per row a committed prefix of ``length[b]`` slots,
then a scratch area for the tree levels. ``prefill`` and ``commit`` consume what the target just accepted and return the root's draft
logits and state; ``step`` drafts one tree level (the ``Drafter`` protocol of fsd_eagle.tree). Draft
logits cover the draft vocabulary (``use_vocab``, from TreeConfig.draft_vocab): all tokens by default. An
EAGLE-3 head drafts over its own vocabulary instead (its lm_head's columns, ``vocab`` = their target ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import parallel
from .attention import no_cudnn, prepare_mask, whole_blocks
from .cache import SlotMask
from .config import TreeConfig
from .errors import ConfigError
from .head import RANKING_FILE, EagleHead
from .ops import pick
from .target import Target


@dataclass
class DraftRoot:
    """The draft's view after each row's committed prefix: logits ``[B, V_d]`` of q_root and its state
    ``[B, s]``."""

    logits: torch.Tensor
    state: torch.Tensor


class SlotDrafter:
    """Shared bookkeeping; subclasses define ``_forward`` (rows -> states), ``lm`` (the model whose lm_head
    turns states into logits) and ``ranking`` (token ids by frequency, for a draft vocabulary; or None)."""

    length: torch.Tensor  # committed slots per batch row (``[B]`` long tensor)
    max_len: int
    slides = False  # whether the drafter attends through a sliding window (then masks carry key positions)
    lm: Target
    ranking: torch.Tensor | None = None

    def __init__(self) -> None:
        # The draft vocabulary in use (TreeConfig.draft_vocab, set by ``allocate``): token ids ``[V_d]``
        # (None: all) and their lm_head rows (weight, bias), kept per size and ranking so that captured graphs
        # stay valid.
        self.vocab: torch.Tensor | None = None
        self.vocab_lm: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._vocabs: dict[tuple[int, int], tuple] = {}

    def _forward(self, tokens, states, positions, slots, mask, backend: str | None = None) -> torch.Tensor:
        raise NotImplementedError

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """The tensors with a batch dimension that a round reads (lengths, cache), each with that dimension's
        index (see ``decode.mark_batch_dynamic``)."""
        raise NotImplementedError

    def _read(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[B, P, s_t]`` as this drafter's committed states (default: as they are)."""
        return features

    def logits(self, states: torch.Tensor, full: bool = False) -> torch.Tensor:
        """Draft logits ``[n, V_d]`` of states ``[n, s]`` over the draft vocabulary (column i is token
        ``vocab[i]``), or ``[n, V]`` over every token when ``full`` or without a draft vocabulary."""
        if full or self.vocab_lm is None:
            return self.lm.logits(states)
        return self.lm.logits(states, *self.vocab_lm)

    @property
    def ranks_vocab(self) -> bool:
        """Whether a tree's ``draft_vocab`` can narrow this drafter's proposals (it has a token ranking)."""
        return self.ranking is not None

    @property
    def proposal_vocab_size(self) -> int:
        """How many tokens this drafter can propose (before any tree's ``draft_vocab``)."""
        return self.lm.vocab_size

    def limits_vocab(self, size: int) -> bool:
        """Whether drafting among ``size`` tokens restricts anything (0, or the whole vocabulary: no); a
        ConfigError if it would and this drafter has no token ranking."""
        if size == 0 or size >= self.lm.vocab_size:
            return False
        if self.ranking is None:
            raise ConfigError(f"draft_vocab {size} needs a draft head with a token ranking ({RANKING_FILE}, "
                              "written by the trainer); this drafter has none (use draft_vocab 0)")
        return True

    def use_vocab(self, size: int) -> None:
        """Draft among the ``size`` best-ranked tokens from now on (0, or the whole vocabulary: all tokens)."""
        if not self.limits_vocab(size):
            self.vocab = self.vocab_lm = None
            return
        key = (size, self.ranking.data_ptr())
        if key not in self._vocabs:
            ids = self.ranking[:size].sort().values.to(self.lm.device)
            head = self.lm.lm_head  # rows gathered from every rank when tensor-parallel (no collective later)
            bias = None if head.bias is None else parallel.replicated(head.bias)[ids].contiguous()
            self._vocabs[key] = (ids, (parallel.replicated(head.weight)[ids].contiguous(), bias))
        self.vocab, self.vocab_lm = self._vocabs[key]

    @torch.no_grad()
    def commit(self, next_tokens: torch.Tensor, features: torch.Tensor, n_accepted: torch.Tensor,
               backend: str | None = None, grow: torch.Tensor | None = None, slots_read: int | None = None
               ) -> DraftRoot:
        """Consume each row's accepted path: next_tokens ``[B, P]`` (the token after each path node: accepted
        drafts, then the bonus), the target's features at the path nodes ``[B, P, h]``; only the first
        ``n_accepted[b]`` entries count (the rest is padding written to scratch slots). The lengths grow by
        ``grow`` (default: ``n_accepted``; 0 for a row that is not decoding). ``backend``: of attention
        (default: the target's). ``slots_read``: attention reads only the cache's first slots_read slots
        (a prefill into an empty cache: its own P; default all)."""
        features = self._read(features)
        b, n = next_tokens.shape
        idx = torch.arange(n, device=next_tokens.device)
        slots = self.length.unsqueeze(1) + idx
        causal = (idx.unsqueeze(1) >= idx.unsqueeze(0)).expand(b, n, n)
        mask = SlotMask(self.length, causal, slots_read or self.max_len)
        states = self._forward(next_tokens, features, slots, slots, mask, backend)
        state = pick(states, n_accepted - 1)
        self.length.add_(n_accepted if grow is None else grow)
        return DraftRoot(self.logits(state), state)

    @torch.no_grad()
    def step(self, depth: int, tokens: torch.Tensor, states: torch.Tensor, rows_anc: torch.Tensor):
        """One tree level of every batch row: frontier ``[B, k]`` goes to scratch slots level-major after the
        row's prefix, at position length + depth - 1."""
        k = tokens.shape[1]
        offsets = torch.arange(rows_anc.shape[2], device=tokens.device)
        start = self.length.unsqueeze(1)
        area = start + offsets
        # Level d's rows sit at position length + d - 1 (read only under a sliding window).
        keys = start + offsets // k if self.slides else None
        mask = SlotMask(self.length, rows_anc, self.max_len, key_positions=keys)
        positions = (start + depth - 1).expand(-1, k)
        out = self._forward(tokens, states, positions, area[:, (depth - 1) * k: depth * k], mask)
        return self.logits(out), out


class EagleDrafter(SlotDrafter):
    """EAGLE head over a target. Head row t reads (e(x_{t+1}), f_t) at position t, so after a commit its
    length equals the target's and its state is the predicted feature f_{L}.

    An eagle3 head reads (e(x_{t+1}), g_t), g_t fused from the target layers it names (the target captures
    them in its own forwards, see ``Target.capture``), and drafts with its own lm_head: ``vocab`` holds
    the target ids of its draft columns (i + d2t[i]; None when they are every token in order). The
    distribution over every token (``logits(full=True)``, the fuzzy rules' q) is the draft distribution
    placed on those ids, with logit -inf (probability 0) for tokens outside the draft vocabulary."""

    def __init__(self, head: EagleHead, target: Target) -> None:
        super().__init__()
        self.head, self.target = head, target
        self.eagle3 = head.config.eagle3
        if self.eagle3:
            target.capture(head.config.layers)
            ids = head.draft_ids()
            self.draft_ids = None if ids is None else ids.to(target.device)
        self.length = torch.zeros(1, dtype=torch.long, device=target.device)
        self.cache = None
        self.max_len = 0

    def allocate(self, max_len: int, tree: TreeConfig, batch: int = 1) -> None:
        size = whole_blocks(max_len + (tree.depth - 1) * tree.top_k)
        if self.cache is None or self.max_len < size or self.cache.keys.shape[0] != batch:
            self.cache = self.head.new_cache(size, self.target.device, self.target.dtype, batch)
            self.max_len = size
        if self.length.shape[0] != batch:
            self.length = torch.zeros(batch, dtype=torch.long, device=self.target.device)
        self.length.zero_()
        self.use_vocab(tree.draft_vocab)

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        return [(self.length, 0)] + (self.cache.batch_tensors() if self.cache is not None else [])

    def load_rows(self, rows: torch.Tensor, other: "EagleDrafter", src: torch.Tensor) -> None:
        """Rows ``rows`` (``[k]`` index tensor) take the cache and length of ``other``'s rows ``src``."""
        self.cache.keys.index_copy_(0, rows, other.cache.keys.index_select(0, src))
        self.cache.values.index_copy_(0, rows, other.cache.values.index_select(0, src))
        self.length.index_copy_(0, rows, other.length.index_select(0, src))

    @property
    def lm(self) -> Target:
        return self.target

    @property
    def ranking(self) -> torch.Tensor | None:
        return self.head.token_ranking

    @property
    def ranks_vocab(self) -> bool:
        """eagle3: no; the head drafts over its own vocabulary."""
        return not self.eagle3 and super().ranks_vocab

    @property
    def proposal_vocab_size(self) -> int:
        """eagle3: the head's own draft vocabulary."""
        return (self.eagle3 and self.head.config.draft_vocab_size) or super().proposal_vocab_size

    def limits_vocab(self, size: int) -> bool:
        if self.eagle3 and 0 < size < self.lm.vocab_size:
            raise ConfigError(f"draft_vocab {size}: an eagle3 head drafts over its own vocabulary of "
                              f"{self.head.config.draft_vocab_size} tokens (use draft_vocab 0)")
        return super().limits_vocab(size)

    def use_vocab(self, size: int) -> None:
        if not self.eagle3:
            return super().use_vocab(size)
        self.limits_vocab(size)
        self.vocab, self.vocab_lm = self.draft_ids, None

    def logits(self, states: torch.Tensor, full: bool = False) -> torch.Tensor:
        """eagle2: see SlotDrafter.logits. eagle3: the head's lm_head ``[..., V_d]`` (column i is token
        ``vocab[i]``), or with ``full`` placed on the target's ``[..., V]`` (-inf elsewhere)."""
        if not self.eagle3:
            return super().logits(states, full)
        logits = self.head.draft_logits(states)
        if not full or self.vocab is None:
            return logits
        whole = logits.new_full(logits.shape[:-1] + (self.lm.vocab_size,), float("-inf"))
        return whole.index_copy(-1, self.vocab, logits)

    def _read(self, features: torch.Tensor) -> torch.Tensor:
        """eagle2: f as it is. eagle3: g = fc of the captured layers' states (the target's features after f)."""
        if not self.eagle3:
            return features
        return self.head.fuse(features[..., self.target.hidden_size:].to(self.head.fc.weight.dtype))

    def _forward(self, tokens, states, positions, slots, mask, backend=None):
        embeds = self.target.draft_embed(tokens)
        heads = self.head.config.num_attention_heads, self.head.config.num_key_value_heads
        mask = prepare_mask(mask, backend or self.target.attention, embeds.dtype, *heads)
        return self.head(embeds, states.to(embeds.dtype), positions, self.cache, slots, mask)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, features: torch.Tensor, n: torch.Tensor | None = None) -> DraftRoot:
        """Fill the cache from slot 0: tokens ``[B, L + 1]`` (the prompts and the target's first tokens), the
        target's features ``[B, L, h]``. With ``n`` (``[B]``), only the first n + 1 tokens and n features of a row are real (padded
        prompts)."""
        if n is None:
            n = torch.full((features.shape[0],), features.shape[1], device=features.device)
        self.length.zero_()
        with no_cudnn():
            return self.commit(tokens[:, 1:], features, n, "sdpa", slots_read=tokens.shape[1] - 1)


class ModelDrafter(SlotDrafter):
    """A small causal LM as the drafter; its cache also holds the root (length = the target's + 1)."""

    def __init__(self, model: Target, ranking: torch.Tensor | None = None) -> None:
        super().__init__()
        self.model = model
        self.ranking = ranking  # token ids by frequency, for a draft vocabulary (optional)
        self.max_len = 0

    @property
    def length(self) -> torch.Tensor:
        return self.model.length

    def allocate(self, max_len: int, tree: TreeConfig, batch: int = 1) -> None:
        self.model.allocate(max_len + 1 + (tree.depth - 1) * tree.top_k, batch)
        self.max_len = self.model.cache.max_len
        self.use_vocab(tree.draft_vocab)

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        return self.model.batch_tensors()

    def load_rows(self, rows: torch.Tensor, other: "ModelDrafter", src: torch.Tensor) -> None:
        self.model.load_rows(rows, other.model, src)

    @property
    def lm(self) -> Target:
        return self.model

    @property
    def cache(self):
        return self.model.cache

    @property
    def slides(self) -> bool:
        return self.model.slides

    def _forward(self, tokens, states, positions, slots, mask, backend=None):
        return self.model.run(tokens, positions, slots, mask, backend)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, features: torch.Tensor, n: torch.Tensor | None = None) -> DraftRoot:
        """See EagleDrafter.prefill (the target's features are not used)."""
        f = self.model.prefill(tokens)
        if n is None:
            state = f[:, -1]
        else:
            self.model.length.copy_(n + 1)
            state = pick(f, n)
        return DraftRoot(self.logits(state), state)
