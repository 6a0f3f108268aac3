"""Target adapter: any stock transformers causal LM, run over prefixes and token trees with a slot KV cache.

Data flow per round, for B rows at once (each with its own prefix length): ``forward_tree(tokens, depths,
anc)`` writes each row's n tree tokens after its committed prefix and returns their features (f, the last
hidden state after the final norm and the lm_head input; then, for an EAGLE-3 drafter, the hidden states
entering the chosen decoder layers, captured in the same forward); the caller picks the accepted paths, then
``commit(path, n_accepted)`` compacts each into its row's prefix.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch import nn

from . import attention, parallel
from .cache import SlotCache, SlotMask
from .errors import ConfigError, HeadMismatchError
from .ops import project


class Target:
    """Wraps an ``AutoModelForCausalLM`` without changing its modeling code.

    Attributes: ``model``, ``config`` (the text config), ``hidden_size``, ``vocab_size``, ``device``,
    ``dtype``, ``cache`` (the slot cache of B rows, from ``allocate``), ``length`` (``[B]`` long tensor on the
    device: each row's committed prefix length L), ``attention`` (the tree-attention backend, see
    fsd_eagle.attention; set with ``use_attention``), ``feature_layers`` (decoder layers whose input hidden
    states the features carry after f; empty unless an EAGLE-3 drafter asks, ``capture``). A Target is the
    model bound to one cache: every session makes its own over the shared weights.

    A tensor-parallel model (fsd_eagle.parallel) runs as transformers sharded it: each rank's attention sees
    its ``tp_size``-th of the heads, so the cache holds that share of the key-value heads. ``draft_embed``
    is the embedding a drafter reads (default: the model's; a replicated copy of a sharded one).

    Features ``[B, n, h * (1 + m)]``, m = len(feature_layers): f, then the m captured states in order.
    """

    def __init__(self, model: nn.Module, draft_embed: nn.Module | None = None) -> None:
        self.model = model.eval()
        config = model.config
        self.config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.embed = model.get_input_embeddings()
        self.draft_embed = draft_embed if draft_embed is not None else self.embed
        self.tp_size = parallel.tp_size_of(model)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        self.layer_types = list(getattr(self.config, "layer_types", None) or [])
        self.sliding_window = getattr(self.config, "sliding_window", None)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 1 << 30))
        # transformers renamed `past_key_values` to `cache` in late 5.x releases: support both.
        params = inspect.signature(self.base.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.cache: SlotCache | None = None
        self.length = torch.zeros(1, dtype=torch.long, device=self.device)
        self.attention = "sdpa"
        self.feature_layers: tuple[int, ...] = ()
        if getattr(model.config, "_attn_implementation", None) == "sdpa":
            self.route_attention()  # the same SDPA forwards, and prefills that read their own slots only

    def capture(self, layers: tuple[int, ...]) -> None:
        """Carry the hidden states entering decoder layers ``layers`` (id i: transformers' hidden_states[i],
        the output of layer i - 1) in every forward's features from now on. A HeadMismatchError if the
        model has no such layer."""
        n = int(self.config.num_hidden_layers)
        if any(not 0 <= i < n for i in layers):
            raise HeadMismatchError(f"a drafter reads target layers {list(layers)}, the target has {n} (ids 0 to {n - 1})")
        self.feature_layers = tuple(layers)
        if layers:
            install_capture_hooks(self.base)

    def use_attention(self, backend: str) -> None:
        """Switch the tree-attention backend of rounds ("sdpa" or "flex", see fsd_eagle.attention; prefills
        always use "sdpa"). For "flex" the model runs our registered attention function (``route_attention``),
        which leaves transformers' own calls (``generate``) on stock SDPA."""
        if backend == self.attention:
            return
        attention.check_backend(backend, self.config)
        if backend == "flex":
            self.route_attention()
        self.attention = backend

    @property
    def routed(self) -> bool:
        """Whether the model's attention runs through our registered function (``route_attention``)."""
        return getattr(self.model.config, "_attn_implementation", None) == attention.ATTENTION_NAME

    def route_attention(self) -> None:
        """Run the model's attention through our registered function (``attention.tree_attention``) from now
        on, where FlexAttention fits the model (else nothing changes). It sends BlockMasks to FlexAttention
        and every other mask to transformers' stock SDPA function, so SDPA forwards compute what they did
        (over the slots a narrower mask covers: ``attention.mask_keys``). A model loaded with SDPA is routed
        when its first Target is made.

        The choice is a field of the model's config, shared by every Target over the model, and compiled
        code guards on it: a prefill compiled before some round switched it to FlexAttention would compile
        again for the next Session. Sessions therefore route attention before anything compiles."""
        if not attention.flex_supported(self.config):
            return
        attention.register()
        if getattr(self.model.config, "_attn_implementation", None) != attention.ATTENTION_NAME:
            self.model.set_attn_implementation(attention.ATTENTION_NAME)

    @property
    def slides(self) -> bool:
        """Whether some layer attends through a sliding window."""
        return bool(self.sliding_window) and (not self.layer_types or "sliding_attention" in self.layer_types)

    @property
    def num_kv_heads(self) -> int:
        """Key-value heads of this rank's attention (all of them unless tensor-parallel)."""
        heads = int(getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads)
        return heads // self.tp_size

    @property
    def num_q_heads(self) -> int:
        """Query heads of this rank's attention (all of them unless tensor-parallel)."""
        return int(self.config.num_attention_heads) // self.tp_size

    @property
    def head_dim(self) -> int:
        return int(getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads)

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    def allocate(self, max_len: int, batch: int = 1) -> None:
        """(Re)allocate the cache for ``batch`` rows of ``max_len`` slots (rounded up to whole FlexAttention
        blocks, so that either backend can use it) only when it is too small or of another batch; reset the
        lengths."""
        max_len = attention.whole_blocks(max_len)
        if self.cache is None or self.cache.max_len < max_len or self.cache.batch != batch:
            self.cache = SlotCache(self.config.num_hidden_layers, self.num_kv_heads, self.head_dim, max_len,
                                   self.dtype, self.device, batch)
        if self.length.shape[0] != batch:
            self.length = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.length.zero_()

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """The tensors with a batch dimension that a round reads, each with that dimension's index (see
        ``decode.mark_batch_dynamic``): ``length`` (0) and the cache's (``SlotCache.batch_tensors``)."""
        return [(self.length, 0)] + (self.cache.batch_tensors() if self.cache is not None else [])

    def load_rows(self, rows: torch.Tensor, other: "Target", src: torch.Tensor) -> None:
        """Rows ``rows`` (``[k]`` index tensor) take the cache and length of ``other``'s rows ``src``."""
        self.cache.load_rows(rows, other.cache, src)
        self.length.index_copy_(0, rows, other.length.index_select(0, src))

    @torch.no_grad()
    def run(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, mask: SlotMask,
            backend: str | None = None) -> torch.Tensor:
        """One forward over new tokens. tokens, positions, slots: ``[B, n]``; mask: what each row sees;
        ``backend`` of attention (default: ``self.attention``). Returns the features ``[B, n, h * (1 + m)]``
        (f alone, ``[B, n, h]``, unless layers are captured: only then are hidden states kept)."""
        cache = self.cache
        if cache is None:
            raise ConfigError("Target.allocate(max_len) must be called before a forward")
        cache.set_write_slots(slots)
        masks = self._masks(mask, positions, backend or self.attention)
        layers = self.feature_layers
        out = self.base(input_ids=tokens, position_ids=positions, attention_mask=masks, use_cache=True,
                        **{self.cache_kwarg: cache}, **({"output_hidden_states": True} if layers else {}))
        if not layers:
            return out.last_hidden_state
        return torch.cat([out.last_hidden_state] + [out.hidden_states[i] for i in layers], -1)

    def _masks(self, mask: SlotMask, positions: torch.Tensor, backend: str):
        """The mask(s) in the attention backend's form; sliding-window layers get the window on key
        positions too. Models without ``layer_types`` (Mistral, Phi-3, ...) slide on every layer whenever
        ``sliding_window`` is set."""
        heads = self.num_q_heads, self.num_kv_heads
        if not self.slides:
            return attention.prepare_mask(mask, backend, self.dtype, *heads)
        window = attention.prepare_mask(mask.windowed(positions, self.sliding_window), backend, self.dtype, *heads)
        if not self.layer_types:
            return window
        return {"full_attention": attention.prepare_mask(mask, backend, self.dtype, *heads),
                "sliding_attention": window}

    def logits(self, features: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """lm_head (with the model's final soft-capping, if any) in float32: ``[..., h] -> [..., V]``; with
        ``weight`` ``[V', h]`` (and ``bias``), those rows of it instead (a draft vocabulary): ``[..., V']``.
        Features that carry captured layers (``[..., h * (1 + m)]``) are read through their f."""
        if features.shape[-1] != self.hidden_size:
            features = features[..., :self.hidden_size]
        if weight is not None:
            logits = project(features, weight, bias)
        elif type(self.lm_head) is nn.Linear and self.tp_size == 1:
            logits = project(features, self.lm_head.weight, self.lm_head.bias)
        else:  # e.g. sharded: transformers' hooks around the module gather the vocabulary
            logits = self.lm_head(features)
        logits = logits.float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Run prompts ``[B, L]`` (one length) into the cache from slot 0 (whatever it held); returns f ``[B, L,
        h * (1 + m)]``; lengths become L. Attention reads slots 0..L-1 only (a mask of L columns) where the model
        runs our attention function (``routed``)."""
        b, n = tokens.shape
        self.length.zero_()
        pos = torch.arange(n, device=self.device).expand(b, n)
        causal = (pos.unsqueeze(2) >= pos.unsqueeze(1))
        # Only our attention function reads a narrower mask's slots alone (a model's own SDPA or eager
        # attention takes the whole cache).
        slots = n if self.routed else self.cache.max_len
        with attention.no_cudnn():
            features = self.run(tokens, pos, pos, SlotMask(self.length, causal, slots), "sdpa")
        self.length.fill_(n)
        return features

    @torch.no_grad()
    def forward_tree(self, tokens: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor) -> torch.Tensor:
        """Verify forward over each row's tree after its prefix: tokens, depths ``[B, n]``; anc ``[B, n, n]``
        bool (ancestor-or-self). Writes slots L..L+n-1 at positions L + depth; returns the features ``[B, n,
        h * (1 + m)]`` (see ``run``)."""
        n = tokens.shape[1]
        start = self.length.unsqueeze(1)
        slots = start + torch.arange(n, device=self.device)
        return self.run(tokens, start + depths, slots, SlotMask(self.length, anc, self.cache.max_len))

    def commit(self, path: torch.Tensor, n_accepted: torch.Tensor) -> None:
        """Keep each row's accepted root path: node path[b, i] (a tree index, ``[B, P]``, padded) moves to
        slot L_b + i; the lengths grow by ``n_accepted`` ``[B]`` (0 for a row that is not decoding)."""
        start = self.length.unsqueeze(1)
        self.cache.compact(start + path, start + torch.arange(path.shape[1], device=self.device))
        self.length.add_(n_accepted)


def install_capture_hooks(module: nn.Module) -> None:
    """Install now the forward hooks through which ``module`` (a transformers model whose forward captures
    outputs) returns hidden states. transformers installs them lazily, in the first forward that asks for
    hidden states, under a threading lock and with a class-level counter of hook handles, neither of which
    dynamo can trace: a compiled prefill or round that made that first forward broke into several graphs,
    and a function with a graph break cannot be saved whole (fsd_eagle.precompiled). Installed here, every
    forward finds them in place. Nothing to do where this transformers has no lazily installed hooks."""
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    maybe_install_capturing_hooks(module)


@contextlib.contextmanager
def attention_flag_kept():
    """Within: the module-level flag that transformers' kernelized attention classes set before and reset
    after each attention call (the ``kernels`` package's active-kernel variable, there where that package is
    installed, as transformers 5.25 installs it) is put back on exit as it was on entry. Dynamo (torch 2.13)
    drops an attribute assignment made after a FlexAttention call within a traced function, so a compiled
    FlexAttention round replays the flag's set and not its reset and leaves it set; the next compilation of a
    prefill or round then finds another value than the first did, fails its guards and compiles once more.
    Around every compiled call (``decode._compile``), nothing compiles twice. Nothing to do where the package
    is absent."""
    flag = _attention_flag()
    if flag is None:
        yield
        return
    saved = flag.global_var, flag.uses_global_var
    try:
        yield
    finally:
        flag.global_var, flag.uses_global_var = saved


def _attention_flag():
    """The ``kernels`` package's active-kernel variable where it is loaded and has the known form, else None."""
    module = sys.modules.get("kernels._internals.layer.layer")
    flag = getattr(module, "_ACTIVE_KERNEL_FUNCS", None)
    return flag if hasattr(flag, "global_var") and hasattr(flag, "uses_global_var") else None
