"""EAGLE draft heads: one Llama-style decoder layer over the target's features, in two architectures.

EAGLE-1/2 (``arch="eagle2"``). Symbols (EAGLE paper): f_t is the target's last hidden state after the final
norm at position t; the head reads (e(x_{t+1}), f_t) through ``fc`` over [e; f] and predicts f_{t+1}; the
target's frozen lm_head turns that into q(x_{t+2}). Parameter names follow the published EAGLE layout
(``fc.*``, ``layers.0.*``), so those checkpoints load as is. Layer 0 has no input_layernorm (as in EAGLE)
and the head has no final norm.

EAGLE-3 (``arch="eagle3"``, Li et al. 2025). The target's feature at t is g_t = fc([l_t; m_t; h_t]), the
hidden states entering the target's decoder layers ``HeadConfig.layers`` (low, middle, high; before the
final norm) fused by ``fc: Linear(3h -> h)``. The decoder layer (``midlayer``, as published) attends over
[input_layernorm(e(x_{t+1})); hidden_norm(a_t)] (width 2h), a_t = g_t for a committed position and the
head's own previous output inside a draft; its residual stream is a_t. The head has its own final ``norm``
and ``lm_head`` over a draft vocabulary of ``draft_vocab_size`` tokens: draft column i is target token
i + d2t[i]; t2d[v] says whether target token v is among them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from .attention import attend
from .errors import ConfigError, HeadMismatchError
from .ops import project

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # what MLP implements
ARCHS = ("eagle2", "eagle3")


def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high target layers (2, L // 2, L - 3) of a target with L decoder layers,
    kept inside 0 .. L - 1 for very shallow targets."""
    return tuple(sorted(min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)))


@dataclass
class HeadConfig:
    """Shape of a draft head; ``rope_parameters`` are the target's (full-attention) RoPE settings.

    ``arch``: "eagle2" (EAGLE-1/2) or "eagle3". For eagle3, ``layers`` are the target layers whose input
    hidden states are fused (id i: the state entering decoder layer i, i.e. the output of layer i - 1; the
    published ``eagle_aux_hidden_state_layer_ids``), and ``draft_vocab_size`` the size of the head's own
    lm_head (0: the whole vocabulary). An eagle2 head has neither."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    max_position_embeddings: int = 8192
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    target: str = ""
    arch: str = "eagle2"
    layers: tuple[int, ...] = ()
    draft_vocab_size: int = 0

    def __post_init__(self) -> None:
        """Refuse values a head cannot be built from (a head config is also read from a user's file), each
        with one line: sizes must be whole numbers that divide as attention needs, eps a positive number,
        the RoPE settings complete for their type."""
        for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                     "max_position_embeddings"):
            _check_count(name, getattr(self, name))
        if self.head_dim is not None:
            _check_count("head_dim", self.head_dim)
        elif self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"head hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                              f"{self.num_attention_heads} (and no head_dim is given)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"head num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        eps = self.rms_norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps <= 0:
            raise ConfigError(f"head rms_norm_eps must be a number > 0, got {eps!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"head hidden_act must be one of {', '.join(ACTIVATIONS)}, got {self.hidden_act!r}")
        if not isinstance(self.attention_bias, bool):
            raise ConfigError(f"head attention_bias must be true or false, got {self.attention_bias!r}")
        if not isinstance(self.target, str):
            raise ConfigError(f"head target must be a string, got {self.target!r}")
        _check_rope(self)
        self._check_arch()

    def _check_arch(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"head arch must be one of {', '.join(ARCHS)}, got {self.arch!r}")
        if not isinstance(self.layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers):
            raise ConfigError(f"head layers must be a list of target layer ids >= 0, got {self.layers!r}")
        self.layers = tuple(self.layers)
        if not isinstance(self.draft_vocab_size, int) or isinstance(self.draft_vocab_size, bool) \
                or not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ConfigError(f"head draft_vocab_size must be an integer from 0 to vocab_size {self.vocab_size}, "
                              f"got {self.draft_vocab_size!r}")
        if self.arch == "eagle2" and (self.layers or self.draft_vocab_size):
            raise ConfigError("an eagle2 head reads the target's last hidden state: layers and draft_vocab_size "
                              "are eagle3 settings")
        if self.arch == "eagle3":
            if not self.layers:
                raise ConfigError("an eagle3 head needs the target layers it reads (layers)")
            self.draft_vocab_size = self.draft_vocab_size or self.vocab_size

    @property
    def eagle3(self) -> bool:
        return self.arch == "eagle3"

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_target(cls, target_config, **overrides) -> "HeadConfig":
        """A head shaped like the target's decoder layers (EAGLE's choice), with the target's RoPE; with
        ``arch="eagle3"`` and no ``layers``, the published default layers (``default_layers``)."""
        c = target_config
        if overrides.get("arch") == "eagle3" and not overrides.get("layers"):
            overrides["layers"] = default_layers(c.num_hidden_layers)
        kwargs = dict(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            vocab_size=c.vocab_size,
            head_dim=getattr(c, "head_dim", None),
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            hidden_act=_act_name(c),
            attention_bias=bool(getattr(c, "attention_bias", False)),
            max_position_embeddings=getattr(c, "max_position_embeddings", 8192),
            rope_parameters=target_rope_parameters(c),
            target=_target_name(c),
        )
        kwargs.update(overrides)
        return cls(**kwargs)


def _target_name(config) -> str:
    """The target's name for a head's config: a hub id as given, a local folder by its own name (a head
    must not record the path of the machine it was trained on)."""
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")
    return Path(name).name if Path(name).is_absolute() or Path(name).is_dir() else name


def target_rope_parameters(config) -> dict:
    """The target's RoPE settings for full-attention layers, as a plain dict (transformers 5.x layouts)."""
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "full_attention" in rope:
        rope = rope["full_attention"]
    if not rope:
        rope = {"rope_type": "default", "rope_theta": float(getattr(config, "rope_theta", 10000.0))}
    return {k: v for k, v in dict(rope).items() if v is not None}


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"head {name} must be an integer >= 1, got {value!r}")


def _rope_config(cfg: HeadConfig) -> LlamaConfig:
    """The config the head's rotary embedding is built from."""
    return LlamaConfig(hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, head_dim=cfg.dim,
                       max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(cfg.rope_parameters))


def _check_rope(cfg: HeadConfig) -> None:
    """Build the rotary embedding on the meta device (no memory): transformers checks the RoPE fields (and
    the attention shape) there."""
    from huggingface_hub.errors import StrictDataclassError  # what transformers' config validators raise

    rope = cfg.rope_parameters
    if not isinstance(rope, dict) or not isinstance(rope.get("rope_type", "default"), str):
        raise ConfigError(f"head rope_parameters must be an object with a rope_type, got {rope!r}")
    try:
        with torch.device("meta"):
            LlamaRotaryEmbedding(_rope_config(cfg))
    except (KeyError, ValueError, TypeError, AttributeError, ZeroDivisionError, StrictDataclassError) as e:
        cause = e.__cause__ if isinstance(e, StrictDataclassError) and e.__cause__ else e
        message = " ".join(str(cause).strip("'\"").split())
        raise ConfigError(f"head settings are not usable (rope_parameters {rope!r}): {message}") from None


def _act_name(config) -> str:
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
    return "gelu_pytorch_tanh" if act.startswith("gelu") else act


def check_fit(cfg: HeadConfig, target_config, name: str = "draft head") -> None:
    """A HeadMismatchError (one line) unless a head of ``cfg`` fits the target: its hidden size and
    vocabulary, and for eagle3 target layers that exist."""
    if cfg.hidden_size != target_config.hidden_size:
        raise HeadMismatchError(f"{name} has hidden size {cfg.hidden_size}, the target has {target_config.hidden_size}")
    if cfg.vocab_size != target_config.vocab_size:
        raise HeadMismatchError(f"{name} was built for a vocabulary of {cfg.vocab_size}, "
                                f"the target has {target_config.vocab_size}")
    n = target_config.num_hidden_layers
    if any(i >= n for i in cfg.layers):
        raise HeadMismatchError(f"{name} reads target layers {list(cfg.layers)}, the target has {n} "
                                f"(ids 0 to {n - 1})")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _fuse_linears(module: nn.Module, fused: str, parts: tuple[str, ...]) -> None:
    """Keep the published layout's separate linears (``parts``, e.g. q_proj/k_proj/v_proj) in state dicts
    while the module holds them as one linear ``fused`` (their weights stacked by rows): one GEMM instead of
    several in every head forward, each of which costs a kernel launch in a GPU round."""

    def split(mod, state, prefix, meta):
        for kind in ("weight", "bias"):
            if prefix + f"{fused}.{kind}" in state:
                whole = state.pop(prefix + f"{fused}.{kind}")
                for name, piece in zip(parts, whole.split(mod.fused_sizes[fused])):
                    state[prefix + f"{name}.{kind}"] = piece.clone()  # own storage: safetensors refuses shared

    def join(mod, state, prefix, *args):
        for kind in ("weight", "bias"):
            if all(prefix + f"{name}.{kind}" in state for name in parts):
                state[prefix + f"{fused}.{kind}"] = torch.cat([state.pop(prefix + f"{name}.{kind}") for name in parts])

    module.register_state_dict_post_hook(split)
    module.register_load_state_dict_pre_hook(join)


class Attention(nn.Module):
    """Self-attention over inputs of width ``width`` (default h; 2h in EAGLE-3's layer); q/k/v are one
    linear here, three (q_proj, k_proj, v_proj) in state dicts."""

    def __init__(self, cfg: HeadConfig, width: int | None = None) -> None:
        super().__init__()
        d, h, kv = cfg.dim, cfg.num_attention_heads, cfg.num_key_value_heads
        self.n_heads, self.n_kv, self.dim = h, kv, d
        self.fused_sizes = {"qkv_proj": [h * d, kv * d, kv * d]}
        self.qkv_proj = nn.Linear(width or cfg.hidden_size, (h + 2 * kv) * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        _fuse_linears(self, "qkv_proj", ("q_proj", "k_proj", "v_proj"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: "HeadCache | None",
                slots: torch.Tensor | None, mask, context: "Context | None" = None):
        """x ``[B, n, width]``; cos/sin ``[B, n, d]``. Returns (output ``[B, n, h]``, (k, v) of these rows
        ``[B, H_kv, n, d]``).

        - With a cache: keys/values go to each batch row's ``slots`` ``[B, n]`` and ``mask`` (from
          ``attention.prepare_mask``) says what each row sees.
        - Training (no cache, ``mask`` None): causal attention over the n rows, or with ``context`` (an
          unrolled step) attention over the earlier steps' keys followed by these rows' own, as
          ``context.allowed`` says.
        """
        b, n, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.fused_sizes["qkv_proj"], dim=-1)
        q = q.view(b, n, self.n_heads, self.dim).transpose(1, 2)
        k = k.view(b, n, self.n_kv, self.dim).transpose(1, 2)
        v = v.reshape(b, n, self.n_kv, self.dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if kv is not None:
            # Indexing the whole buffer (an index tensor per dimension): inductor lowers a scatter_ into a
            # buffer as two copies of all of it.
            where = (kv.rows, kv.heads, slots.view(b, 1, n))
            kv.keys.index_put_(where, k)
            kv.values.index_put_(where, v)
            out = attend(q, kv.keys, kv.values, mask)
        elif context is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_heads > self.n_kv)
        else:
            out = attend(q, torch.cat((context.keys, k), dim=2), torch.cat((context.values, v), dim=2),
                         context.allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), (k, v)


@dataclass
class Context:
    """What an unrolled training step attends to besides its own rows: the earlier steps' keys/values
    ``[B, H_kv, j*T, d]`` (step 0's rows first) and ``allowed`` ``[T, (j+1)*T]`` (bool, True = may attend)."""

    keys: torch.Tensor
    values: torch.Tensor
    allowed: torch.Tensor


class MLP(nn.Module):
    """Gated MLP; gate/up are one linear here, two (gate_proj, up_proj) in state dicts."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.fused_sizes = {"gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = nn.SiLU() if cfg.hidden_act == "silu" else nn.GELU(approximate="tanh")
        _fuse_linears(self, "gate_up_proj", ("gate_proj", "up_proj"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Llama decoder layer without input_layernorm (EAGLE's layer 0); with ``reads_embeds`` EAGLE-3's
    ``midlayer``: attention over [input_layernorm(e); hidden_norm(x)] (width 2h), residual stream x."""

    def __init__(self, cfg: HeadConfig, reads_embeds: bool = False) -> None:
        super().__init__()
        if reads_embeds:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.reads_embeds = reads_embeds
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size if reads_embeds else None)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv, slots, mask, context=None, embeds=None):
        """x ``[B, n, h]`` (and, for a layer that ``reads_embeds``, embeds ``[B, n, h]``). Returns (output
        ``[B, n, h]``, (k, v) of these rows): see ``Attention.forward``."""
        inputs = torch.cat((self.input_layernorm(embeds), self.hidden_norm(x)), -1) if self.reads_embeds else x
        attn, kv_rows = self.self_attn(inputs, cos, sin, kv, slots, mask, context)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_rows


@dataclass
class HeadCache:
    """The head's own KV rows ``[B, H_kv, S, d]`` (same slot layout as the target's cache), with the index
    tensors of a write (batch rows ``[B, 1, 1]``, heads ``[1, H_kv, 1]``; made once: an arange per forward
    is a kernel launch per forward in graph rounds)."""

    keys: torch.Tensor
    values: torch.Tensor
    rows: torch.Tensor
    heads: torch.Tensor

    def batch_tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Tensors with a batch dimension and its index (see ``decode.mark_batch_dynamic``): all but ``heads``,
        batch first."""
        return [(self.keys, 0), (self.values, 0), (self.rows, 0)]


RANKING_FILE = "token_ranking.safetensors"  # a head folder's token ranking (see EagleHead.token_ranking)


class EagleHead(nn.Module):
    """EAGLE's one-layer draft head (eagle2, or eagle3: see the module docstring). ``token_ranking`` ``[V]``
    (optional, not a weight): every token id, most frequent first in the head's training answers;
    TreeConfig.draft_vocab drafts among its first entries (saved as token_ranking.safetensors next to the
    weights). An eagle3 head also holds ``d2t`` ``[V_d]`` (draft column i is target token i + d2t[i]) and
    ``t2d`` ``[V]`` (bool: the target token is a draft column), as published."""

    token_ranking: torch.Tensor | None

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.config = cfg
        self.register_buffer("token_ranking", None, persistent=False)
        h = cfg.hidden_size
        if cfg.eagle3:
            self.fc = nn.Linear(len(cfg.layers) * h, h, bias=False)
            self.midlayer = DecoderLayer(cfg, reads_embeds=True)
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            # Until loaded: draft column i is token i.
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(cfg.vocab_size) < cfg.draft_vocab_size)
        else:
            self.fc = nn.Linear(2 * h, h, bias=True)
            self.layers = nn.ModuleList([DecoderLayer(cfg)])
        self.rotary = LlamaRotaryEmbedding(_rope_config(cfg))

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return [self.midlayer] if self.config.eagle3 else list(self.layers)

    def draft_ids(self) -> torch.Tensor | None:
        """eagle3: the target token id of each draft column ``[V_d]`` (i + d2t[i]), or None where the draft
        vocabulary is the whole vocabulary in order; eagle2: None (the target's lm_head drafts)."""
        if not self.config.eagle3:
            return None
        ids = torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t
        whole = self.config.draft_vocab_size == self.config.vocab_size and not bool(self.d2t.any())
        return None if whole else ids

    def fuse(self, hidden: torch.Tensor) -> torch.Tensor:
        """eagle3: the target's hidden states at ``config.layers`` ``[B, n, 3h]`` -> g = fc(l; m; h) ``[B, n, h]``."""
        return self.fc(hidden)

    def draft_logits(self, states: torch.Tensor) -> torch.Tensor:
        """eagle3: the head's own lm_head over its draft vocabulary, float32: ``[..., h] -> [..., V_d]``."""
        return project(self.norm(states), self.lm_head.weight, self.lm_head.bias).float()

    def new_cache(self, max_len: int, device: torch.device, dtype: torch.dtype, batch: int = 1) -> HeadCache:
        heads = self.config.num_key_value_heads
        shape = (batch, heads, max_len, self.config.dim)
        # The row index is a tensor of its own, not a view: a compiled round would take a view's base as one
        # more input with a batch dimension.
        return HeadCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                         torch.arange(batch, device=device).view(batch, 1, 1).clone(),
                         torch.arange(heads, device=device).view(1, heads, 1))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                cache: HeadCache | None = None, slots: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds e(x_{t+1}) and features ``[B, n, h]``, positions ``[B, n]`` -> the head's output ``[B, n, h]``.

        eagle2: features f_t, output the predicted f_{t+1}. eagle3: features a_t (the fused target feature
        g_t = ``fuse(...)`` at a committed position, the head's own previous output inside a draft), output
        the next a (``draft_logits`` turns it into draft logits).
        With a cache: keys/values go to ``slots`` ``[B, n]`` and ``mask`` (``[B, n, S]`` prepared by
        ``attention.prepare_mask``) says what each row sees. Without (training): causal attention over the n rows.
        """
        if self.config.eagle3:
            x, inputs = features, embeds
        else:
            x, inputs = self.fc(torch.cat((embeds, features), dim=-1)), None
        cos, sin = self.rotary(x, positions)
        for layer in self.decoder_layers:
            x, _ = layer(x, cos, sin, cache, slots, mask, embeds=inputs)
        return x

    def set_draft_vocab(self, ranking: torch.Tensor) -> None:
        """eagle3: the draft columns become the first ``draft_vocab_size`` tokens of ``ranking`` (every token
        id, most frequent first), in id order: d2t and t2d as published (a whole vocabulary is the identity)."""
        if not self.config.eagle3:
            raise ConfigError("only an eagle3 head has its own draft vocabulary")
        ids = ranking[:self.config.draft_vocab_size].to(self.d2t.device).long().sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def unroll(self, embeds: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3): the head run ``steps`` times on its own predictions, as a draft
        chain runs it. Step 0 is the teacher-forced step: row t reads (e(x_{t+1}), the target's feature at t)
        and predicts the next state. Step j row t reads (e(x_{t+1+j}), step j-1's output at row t) at position
        t + j; it sees step 0's rows <= t (the committed prefix, whose features came from the target) and its
        own row t of every earlier step (the drafted path), as a draft at depth j+1 does.

        eagle2: features f ``[B, T, h]``, step j's output is the predicted f_{t+1+j}. eagle3: features are the
        captured target layers' states ``[B, T, m*h]``, step 0 reads g = ``fuse(...)`` and step j the head's
        own previous output (before its norm; ``draft_logits`` turns an output into x_{t+2+j}'s logits).
        embeds ``[B, T + steps - 1, h]`` (e(x_1) ...); returns ``steps`` outputs, each ``[B, T, h]``.
        ``steps`` = 1 is ``forward`` with causal attention."""
        eagle3 = self.config.eagle3
        b, t, _ = features.shape
        positions = torch.arange(t, device=features.device).expand(b, -1)
        causal = torch.ones(t, t, dtype=torch.bool, device=features.device).tril()
        diagonal = torch.eye(t, dtype=torch.bool, device=features.device)
        layers = self.decoder_layers
        preds, earlier = [], [None] * len(layers)
        x = self.fuse(features) if eagle3 else features
        for j in range(steps):
            inputs = embeds[:, j:j + t]
            if not eagle3:
                x, inputs = self.fc(torch.cat((inputs, x), dim=-1)), None
            cos, sin = self.rotary(x, positions + j)
            allowed = torch.cat([causal] + [diagonal] * j, dim=1)
            for i, layer in enumerate(layers):
                context = None if j == 0 else Context(*earlier[i], allowed)
                x, (k, v) = layer(x, cos, sin, None, None, None, context, embeds=inputs)
                earlier[i] = (k, v) if j == 0 else (torch.cat((earlier[i][0], k), 2), torch.cat((earlier[i][1], v), 2))
            preds.append(x)
        return preds
