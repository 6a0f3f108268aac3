"""Configuration dataclasses: draft tree shape, sampling and the fuzzy (FSD) acceptance rule.

Every dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` with one readable line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError

FUZZY_MODES = ("hybrid", "pure")
OPTIONAL_TREE_KEYS = ("draft_vocab", "pool")  # TreeConfig fields that presets and results write only when set


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the EAGLE-2 dynamic draft tree.

    total_tokens: nodes verified per round, the root (last committed token) included; 1 means plain
        autoregressive decoding (no draft).
    depth: maximum number of draft tokens on a root-to-leaf path.
    top_k: children expanded per frontier node, and frontier width; top_k = 1 gives a chain.
    draft_vocab: draft only among the head's ``draft_vocab`` most frequent tokens (its token ranking; the
        draft vocabulary of FR-Spec / EAGLE-3): each draft level's lm_head and top-k then read that many rows
        instead of the whole vocabulary. 0 (or the vocabulary's size): every token; a generator refuses more
        than its vocabulary. Verification is unchanged, so outputs stay exact; only which tokens can be
        proposed changes.
    pool: with sampled children (``SamplingConfig.children``), each expanded node's children are drawn from
        the draft's ``pool`` most likely tokens (the draft distribution restricted to them, renormalised)
        instead of from all of its vocabulary: still lossless (recursive rejection sampling is exact for any
        proposal), and the rejection tests and each level's random keys then cover ``pool`` entries, not
        the draft vocabulary. 0: the whole draft vocabulary. Ignored by top children and greedy calls;
        children "auto" (the API's default) are sampled on a tree with a pool.
    """

    total_tokens: int = 60
    depth: int = 6
    top_k: int = 10
    draft_vocab: int = 0
    pool: int = 0

    def __post_init__(self) -> None:
        for name in ("total_tokens", "depth", "top_k", "draft_vocab", "pool"):
            value = getattr(self, name)
            least = 0 if name in ("draft_vocab", "pool") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"tree {name} must be an integer >= {least}, got {value!r}")
        if 0 < self.draft_vocab < self.top_k:
            raise ConfigError(f"tree draft_vocab ({self.draft_vocab}) must be 0 or at least top_k ({self.top_k})")
        if 0 < self.pool < self.top_k:
            raise ConfigError(f"tree pool ({self.pool}) must be 0 or at least top_k ({self.top_k})")
        if 0 < self.draft_vocab < self.pool:
            raise ConfigError(f"tree pool ({self.pool}) must be at most draft_vocab ({self.draft_vocab})")

    @property
    def drafts(self) -> bool:
        return self.total_tokens > 1

    @property
    def label(self) -> str:
        """"total/depth/top_k" (plus "/v<draft_vocab>" when the draft vocabulary is limited and "/p<pool>"
        when sampled children come from a pool), "ar" without drafts."""
        if not self.drafts:
            return "ar"
        return (f"{self.total_tokens}/{self.depth}/{self.top_k}" + (f"/v{self.draft_vocab}" if self.draft_vocab else "")
                + (f"/p{self.pool}" if self.pool else ""))

    def to_dict(self) -> dict:
        """The preset / results form: total_tokens, depth, top_k, and draft_vocab and pool when they are set."""
        out = {"total_tokens": self.total_tokens, "depth": self.depth, "top_k": self.top_k}
        return out | {k: getattr(self, k) for k in OPTIONAL_TREE_KEYS if getattr(self, k)}

    @classmethod
    def parse(cls, text: str) -> "TreeConfig":
        """The inverse of ``label``: "60/6/10", "48/5/8/v16384" (a bare fourth number is the draft
        vocabulary too), "64/6/8/p16" or "64/6/8/v16384/p16"."""
        parts = text.strip().split("/")
        extra = {}
        for part in parts[3:]:
            key = "pool" if part.startswith("p") else "draft_vocab"
            if key in extra or (key == "draft_vocab" and "pool" in extra):
                extra = None
                break
            extra[key] = part.removeprefix("p" if key == "pool" else "v")
        if len(parts) < 3 or extra is None or not all(x.isdigit() for x in parts[:3] + list(extra.values())):
            raise ConfigError("expected a tree as total/depth/top_k[/v<draft_vocab>][/p<pool>] (e.g. 60/6/10), "
                              f"got {text!r}")
        return cls(*map(int, parts[:3]), **{k: int(v) for k, v in extra.items()})

    @classmethod
    def parse_list(cls, text: str) -> list["TreeConfig"]:
        """Comma-separated trees: "60/6/10,48/5/8/v16384" (ConfigError naming the first malformed one)."""
        return [cls.parse(item) for item in text.split(",")]

    @property
    def path_len(self) -> int:
        """Longest accepted path in nodes, the root included (depth + 1 when drafting)."""
        return self.depth + 1 if self.drafts else 1


# Sampling works on float32 logits: a temperature or top_p below float32's range rounds to 0 there and the
# distribution becomes NaN, so values beyond these bounds (far past any useful setting) are refused.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6
MIN_TOP_P = 1e-6
MAX_TOP_K = 2**31 - 1
CHILDREN = ("auto", "top", "sampled")  # SamplingConfig.children


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's next token is chosen: temperature 0 is greedy (argmax), else sampling with a
    temperature in [1e-6, 1e6].

    top_k = 0 and top_p = 1.0 disable those filters; top_p is at least 1e-6.
    children: which draft tokens the tree offers under sampling: "top" (each node's k most likely, the
    default) or "sampled" (k drawn without replacement from the draft at the temperature, verified by
    recursive rejection sampling without replacement; also lossless; under FSD the first child drawn, a
    sample of the draft, is the one the fuzzy test may accept); "auto": the tree's choice, "sampled" when
    it draws children from a pool (``TreeConfig.pool``, e.g. a preset's sampling tree), else "top"
    (``AcceptanceRule.form_for``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    children: str = "top"

    def __post_init__(self) -> None:
        t, p = _finite_or_none(self.temperature), _finite_or_none(self.top_p)
        if t is None or t < 0:
            raise ConfigError(f"temperature must be a finite number >= 0, got {_shown(self.temperature)}")
        if 0 < t < MIN_TEMPERATURE or t > MAX_TEMPERATURE:
            raise ConfigError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, "
                              f"got {t!r}")
        if p is None or not 0.0 < p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {_shown(self.top_p)}")
        if p < MIN_TOP_P:
            raise ConfigError(f"top_p must be at least {MIN_TOP_P:g} (smaller keeps only the top token, as "
                              f"top_k=1 does), got {p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ConfigError(f"top_k must be an integer from 0 to 2**31 - 1, got {_shown(self.top_k)}")
        if self.children not in CHILDREN:
            raise ConfigError(f"children must be 'auto', 'top' or 'sampled', got {self.children!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class FuzzyConfig:
    """Fuzzy Speculative Decoding rule (Holsman, Huang, Dhingra 2025) applied per tree node.

    threshold: T >= 0, or math.inf; T = 0 disables fuzzy acceptance (exact EAGLE-2) in hybrid mode.
    divergence: D(p, q) between target p and draft q at a parent node, see fsd_eagle.divergence.
    mode: "hybrid" (exact rule, else accept the draft's top child when D <= T) or "pure" (accept the
        draft's top child iff D <= T).
    support_top_k: > 0 truncates D's support to the top-k tokens of p plus one bin for the rest.
    processed: compute D on the temperature/top-p/top-k processed distributions instead of the raw ones.
    """

    threshold: float = 0.0
    divergence: str = "kl"
    mode: str = "hybrid"
    support_top_k: int = 0
    processed: bool = False

    def __post_init__(self) -> None:
        from .divergence import DIVERGENCES

        t = self.threshold
        if not (_is_number(t) and t == math.inf) and (_finite_or_none(t) is None or t < 0):
            raise ConfigError(f"fuzzy threshold must be a finite number >= 0 or inf, got {_shown(t)}")
        if self.divergence not in DIVERGENCES:
            raise ConfigError(f"unknown divergence {self.divergence!r}; choose one of {', '.join(DIVERGENCES)}")
        if self.mode not in FUZZY_MODES:
            raise ConfigError(f"unknown fuzzy mode {self.mode!r}; choose one of {', '.join(FUZZY_MODES)}")
        if not isinstance(self.support_top_k, int) or isinstance(self.support_top_k, bool) or self.support_top_k < 0:
            raise ConfigError(f"support_top_k must be an integer >= 0, got {_shown(self.support_top_k)}")
        if not isinstance(self.processed, bool):
            raise ConfigError(f"processed must be True or False, got {_shown(self.processed)}")

    @property
    def active(self) -> bool:
        """False when the rule is exactly the lossless one (hybrid at T = 0)."""
        return self.mode == "pure" or self.threshold > 0


def parse_threshold(text: str) -> float:
    """Parse a CLI threshold: a number >= 0, or the words inf / infinity."""
    word = text.strip().lower()
    if word in ("inf", "infinity", "+inf"):
        return math.inf
    try:
        value = float(word)
    except ValueError:
        raise ConfigError(f"threshold must be a number >= 0 or 'inf', got {text!r}") from None
    if math.isinf(value) or math.isnan(value):
        raise ConfigError(f"threshold must be finite or the word 'inf', got {text!r}")
    return value


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite_or_none(x: object) -> float | None:
    """``x`` as a finite float, or None where it is no number, not finite, or an integer beyond float range."""
    if not _is_number(x):
        return None
    try:
        value = float(x)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _shown(x: object) -> str:
    """A value as an error message shows it: short (an integer of 400 digits is not printed whole)."""
    text = repr(x)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def check_seed(seed, what: str = "seed") -> None:
    """InputError unless ``seed`` is an integer torch takes: from -2**63 to 2**64 - 1."""
    from .errors import InputError

    if not isinstance(seed, int) or isinstance(seed, bool) or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise InputError(f"{what} must be an integer from -2**63 to 2**64 - 1, got {_shown(seed)}")
