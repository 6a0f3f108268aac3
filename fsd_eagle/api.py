"""The Python API: ``SpeculativeGenerator.load(...)`` then ``generate`` / ``stream``."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .attention import check_backend
from .config import FuzzyConfig, SamplingConfig, TreeConfig, check_seed
from .decode import DecodeStats
from .drafter import SlotDrafter
from .engine import Engine
from .errors import BusyError, ConfigError, InputError
from .head import EagleHead, HeadConfig
from .models import (default_head_path, load_head, load_target, read_target_config, resolve_device,
                     resolve_dtype)
from .schedule import Request, Scheduler
from .session import Plan, Session, session_rows
from .trees_presets import BUCKETS, model_name
from .target import Target
from .verify import AcceptanceRule

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class GenerationResult:
    """Text and token ids of one call, with its statistics (see DecodeStats)."""

    text: str
    token_ids: list[int]
    stats: DecodeStats
    stop_reason: str  # "eos", "stop_string", "max_new_tokens" or "context"

    def to_dict(self) -> dict:
        s = self.stats
        return {"text": self.text, "new_tokens": s.new_tokens, "target_forwards": s.target_forwards,
                "tau": round(s.tau, 4), "tokens_per_s": round(s.tokens_per_s, 2),
                "fuzzy_accepted": s.fuzzy_accepted, "divergence_mean": s.divergence_mean,
                "elapsed_s": round(s.elapsed_s, 4), "stop_reason": self.stop_reason}


@dataclass
class PreparedCall:
    """Validated arguments of one generation call (``SpeculativeGenerator.prepare``): the prompt ids ``[L]``
    on the target's device, the token budget, the acceptance rule, stop strings and seed."""

    prompt_ids: torch.Tensor
    max_new_tokens: int
    rule: AcceptanceRule
    stop: tuple[str, ...]
    seed: int
    autoregressive: bool
    clipped: bool = False  # max_new_tokens was lowered to fit the model's context
    stats: DecodeStats = field(default_factory=DecodeStats)


class SpeculativeGenerator:
    """The text layer over an engine (a target model, its tokenizer and an optional drafter: an EAGLE head
    or a small draft model): prompts in, text out. Each call runs on a session (fsd_eagle.session) made for
    its plan (tree, rule form, execution mode, batch size) and kept for later calls with the same plan.

    Execution settings are changed through methods that check them (``set_tree``, ``configure``,
    ``use_attention``) and read through properties (``tree``, ``cuda_graphs``, ``compile``, ``attention``).
    """

    def __init__(self, model, tokenizer, head: EagleHead | None = None, draft_model=None,
                 tree: TreeConfig = TreeConfig()) -> None:
        self.engine = Engine(model, tokenizer, head, draft_model)
        # A drafter over ``target`` for tools that time drafting steps directly (decoding uses sessions).
        self.drafter: SlotDrafter | None = self.engine.new_drafter(self.engine.target)
        self._tree = tree
        self._sampling_tree = tree  # of single prompts that sample (the presets' sampling tree, see set_tree)
        self._overrides: dict | None = None  # set_tree's explicit values while the tree follows the presets
        self._cuda_graphs = True  # replay rounds (and prefills) as CUDA graphs on GPUs, for every rule
        self._compile = False  # compile rounds with torch.compile before capture (GPUs; ~1 min once per plan)
        self._attention: str | None = None  # preferred tree attention of compiled rounds (see use_attention)
        self._sessions: dict[Plan, Session] = {}
        self._sessions_lock = threading.Lock()
        self._calls = _OneCall()  # the sessions serve one call at a time
        self._check_tree(tree)

    @property
    def target(self) -> Target:
        """The target (vocabulary, context, device, config; its own cache for tools)."""
        return self.engine.target

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def eos_ids(self) -> frozenset:
        return self.engine.eos_ids

    @property
    def tree(self) -> TreeConfig:
        """The draft tree of single prompts decoded greedily (set with ``set_tree``); while the tree follows
        the presets, batches and sampling calls use theirs (see ``set_tree``)."""
        return self._tree

    @property
    def cuda_graphs(self) -> bool:
        return self._cuda_graphs

    @property
    def compile(self) -> bool:
        return self._compile

    @property
    def attention(self) -> str | None:
        return self._attention

    def configure(self, *, cuda_graphs: bool | None = None, compile: bool | None = None) -> None:
        """Execution mode of later calls on a GPU: ``cuda_graphs`` replays each round and prefill as a CUDA
        graph (default on); ``compile`` compiles rounds with torch.compile before capture (about a minute
        once per plan). Both are ignored on the CPU."""
        for name, value in (("cuda_graphs", cuda_graphs), ("compile", compile)):
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}")
        if cuda_graphs is not None:
            self._cuda_graphs = cuda_graphs
        if compile is not None:
            self._compile = compile

    def release(self) -> None:
        """Drop every session (their caches and captured graphs), e.g. to free GPU memory after a batch."""
        self._sessions.clear()

    @classmethod
    def load(cls, target: str | Path | None = None, head: str | Path | None = None, draft_model: str | Path | None = None,
             device: str | None = None, dtype: str | None = None, tree: TreeConfig | None = None,
             random_head: bool = False, compile: bool = False, threads: int | None = None,
             tp_size: int = 1) -> "SpeculativeGenerator":
        """Load a local target folder (default: SmolLM2-135M-Instruct) with ``head`` (default: the head shipped
        for the target, found by its folder's name: ``fsd_eagle/heads/<name>`` for the default model and Gemma
        3 270M's converted folder; without one, decoding is autoregressive), or a ``draft_model`` folder;
        ``random_head`` builds an untrained head.
        ``compile``: on a GPU, compile each round configuration with torch.compile before graph capture
        (about a minute on first use of a configuration, then several times fewer kernels per round).
        ``threads``: torch CPU threads, set once here with ``torch.set_num_threads`` (for the whole process).
        Default on the CPU: the usable cores less one, at most 4, at least 1 (1 on a 2-core machine, where a
        second thread gained nothing when idle and made decoding much slower as soon as anything
        else ran; see ``fsd_eagle.models.default_threads``), unless OMP_NUM_THREADS is set; on a GPU the
        count is left as it is unless given.

        ``tp_size`` N > 1: the target is sharded over N GPUs by transformers' tensor parallelism, in a process
        per GPU started by ``torchrun --nproc-per-node N`` (each runs this same call, on cuda:LOCAL_RANK); the
        draft head or draft model is replicated on every rank, every rank runs the same rounds and gets the
        same results (see fsd_eagle.parallel). ConfigError when N does not divide the target's heads, when
        the launch has another number of processes, or without NCCL."""
        if head is not None and draft_model is not None:
            raise ConfigError("use either a draft head or a draft model, not both")
        from . import parallel
        from .models import set_threads

        parallel.check_tp_size(tp_size)
        if tp_size > 1:  # everything that can be refused is refused before the process group starts
            parallel.check_launch(tp_size)
            parallel.check_divides(read_target_config(target)[1], tp_size)
        dev = parallel.start(tp_size, device).device if tp_size > 1 else resolve_device(device)
        set_threads(threads, dev)
        dt = resolve_dtype(dtype, dev)
        model, tokenizer = load_target(target, dev, dt, tp_size)
        text_config = model.config.get_text_config()
        if head is None and draft_model is None and not random_head:  # the target's shipped head, if any
            head_path = default_head_path(model_name(model.config), text_config)
        else:
            head_path = head
        head_module = None
        if head_path is not None and draft_model is None:
            head_module = load_head(head_path, text_config, dev, dt)
        elif random_head or (target is None and draft_model is None):
            head_module = EagleHead(HeadConfig.for_target(text_config)).to(dev, dt).eval()
            parallel.broadcast_module(head_module)  # one random head for every rank
        draft = load_target(draft_model, dev, dt)[0] if draft_model is not None else None
        gen = cls(model, tokenizer, head_module, draft, tree or TreeConfig())
        gen.configure(compile=compile)
        if tree is None:  # the tuned preset for this target and device type (fsd_eagle/presets.json), else defaults
            gen.set_tree()
        return gen

    def set_tree(self, total_tokens: int | None = None, depth: int | None = None, top_k: int | None = None,
                 draft_vocab: int | None = None, pool: int | None = None) -> TreeConfig:
        """Use the tuned presets for this target and device (fsd_eagle/presets.json), with any value given
        here overriding them; returns the tree of one prompt at a time. Calls that decode several prompts
        together use the preset of their batch size (smaller trees, or plain autoregressive decoding, where
        the tuner measured them faster), and calls that sample use the presets' sampling tree where they
        hold one, with the same overrides; with any override given, a batch never switches to autoregressive
        decoding. A preset's draft vocabulary applies only to a drafter with a
        token ranking (an EAGLE-2-style head trained here has one), not to an EAGLE-3 head such as the default
        model's shipped head (it drafts over its own vocabulary);
        ``draft_vocab`` = 0 drafts among all tokens; ``pool``: where sampled children come from (TreeConfig)."""
        overrides = dict(total_tokens=total_tokens, depth=depth, top_k=top_k, draft_vocab=draft_vocab, pool=pool)
        tree = self._preset_tree(1, overrides)[0]
        self._check_tree(tree)
        self._tree, self._overrides = tree, overrides
        self._sampling_tree = self._checked_or(self._preset_tree(1, overrides, sampling=True)[0], tree)
        return tree

    def tree_for(self, temperature: float = 0.0, batch: int = 1) -> TreeConfig:
        """The draft tree of a call that decodes ``batch`` prompts together at ``temperature`` (the presets
        of its batch size and rule while the tree follows them, see ``set_tree``); total_tokens 1 where
        that batch decodes without drafting."""
        tree, drafts = self._batch_tree(batch, temperature > 0)
        return tree if drafts else TreeConfig(total_tokens=1, depth=1, top_k=1)

    def _checked_or(self, tree: TreeConfig, fallback: TreeConfig) -> TreeConfig:
        """``tree`` if this generator can draft with it, else ``fallback`` (e.g. a preset's draft vocabulary
        larger than this target's)."""
        try:
            self._check_tree(tree)
        except ConfigError:
            return fallback
        return tree

    def _preset_tree(self, batch: int, overrides: dict, sampling: bool = False) -> tuple[TreeConfig, bool]:
        """The preset tree for ``batch`` prompts (that sample, with ``sampling``) with ``overrides``, and
        whether to draft at all."""
        from .trees_presets import preset, with_overrides

        found = preset(self.target, batch_size=batch, sampling=sampling)
        tree = found.tree
        if overrides["draft_vocab"] is None and (not self._ranks_vocab() or tree.draft_vocab > self.target.vocab_size):
            tree = with_overrides(tree, draft_vocab=0)
        explicit = any(v is not None for v in overrides.values())
        return with_overrides(tree, **overrides), explicit or not found.autoregressive

    def _batch_tree(self, rows: int, sampling: bool = False) -> tuple[TreeConfig, bool]:
        """The tree (and whether to draft) for ``rows`` prompts decoded together, sampling or not: the
        preset of that batch size and rule while the tree follows the presets (``set_tree``), else the tree
        given."""
        if self._overrides is None:
            return self._tree, True
        if rows == 1:
            return (self._sampling_tree if sampling else self._tree), True
        tree, drafts = self._preset_tree(rows, self._overrides, sampling)
        return self._checked_or(tree, self._tree), drafts

    def _ranks_vocab(self) -> bool:
        return self.drafter is not None and self.drafter.ranks_vocab

    def use_attention(self, backend: str | None) -> None:
        """Preferred tree attention of compiled rounds: "sdpa", "flex" or None (the default: "flex" for one
        prompt at a time where the model allows it, measured fastest for compiled GPU rounds; "sdpa" for
        batches, see ``decode.round_attention``). Rounds that are not compiled always use
        SDPA: uncompiled FlexAttention is a slow reference. Each result's ``stats.attention`` says what ran;
        see fsd_eagle.attention."""
        if backend is not None:
            check_backend(backend, self.target.config)
        self._attention = backend

    def _check_tree(self, tree: TreeConfig) -> None:
        if tree.top_k > self.target.vocab_size:
            raise ConfigError(f"tree top_k {tree.top_k} exceeds the vocabulary size {self.target.vocab_size}")
        if tree.draft_vocab > self.target.vocab_size:
            raise ConfigError(f"tree draft_vocab {tree.draft_vocab} exceeds the vocabulary size "
                              f"{self.target.vocab_size} (0 drafts among all tokens)")
        if tree.pool > self.target.vocab_size:
            raise ConfigError(f"tree pool {tree.pool} exceeds the vocabulary size {self.target.vocab_size} "
                              "(0 draws sampled children from the whole draft vocabulary)")
        room = self.target.max_positions
        if tree.total_tokens + tree.depth + 2 >= room:
            raise ConfigError(f"a tree of {tree.total_tokens} tokens and depth {tree.depth} does not fit the "
                              f"model's context of {room} tokens")
        if self.drafter is not None:
            self.drafter.limits_vocab(tree.draft_vocab)  # refuses a draft vocabulary without a ranking
            offered = self.drafter.proposal_vocab_size
            if 0 < tree.draft_vocab < offered:
                offered = tree.draft_vocab
            for name, value in (("top_k", tree.top_k), ("pool", tree.pool)):
                if value > offered:
                    raise ConfigError(f"tree {name} {value} exceeds the {offered} tokens this drafter proposes from "
                                      "(its draft vocabulary)")

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Prompt text (chat template applied when the tokenizer has one, unless chat=False), a list of chat
        messages, or token ids. Every id the tokenizer gives must be one the model has (a tokenizer of
        another model may give more)."""
        return self._known_ids(self._encode(prompt, chat), "the tokenizer gave")

    def _encode(self, prompt: Prompt, chat: bool | None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("the prompt is empty")
            _check_text(prompt, "the prompt")
            use_chat = chat if chat is not None else bool(getattr(self.tokenizer, "chat_template", None))
            if use_chat:
                return self._chat_ids([{"role": "user", "content": prompt}])
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if not isinstance(prompt, Sequence):
            raise InputError("a prompt must be a string, a list of chat messages or a list of token ids")
        items = list(prompt)
        if not items:
            raise InputError("the prompt is empty")
        if all(isinstance(m, dict) for m in items):
            return self._chat_ids(items)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return self._known_ids(items, "the prompt has")
        raise InputError("a prompt must be a string, a list of chat messages or a list of token ids")

    def _known_ids(self, ids: list[int], source: str) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise InputError(f"{source} token id {bad[0]}, outside the model's vocabulary (size "
                             f"{self.target.vocab_size})")
        return ids

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        from jinja2.exceptions import TemplateError

        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError("this tokenizer has no chat template: pass plain text with chat=False")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InputError(f"chat message {i} needs a 'role' and a 'content', both strings; got {m!r:.80}")
            _check_text(m["content"], f"chat message {i}")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except (KeyError, TypeError, ValueError, TemplateError) as e:
            raise InputError(f"bad chat messages: {' '.join(str(e).split())}") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def prepare(self, prompt: Prompt, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                top_k: int = 0, fuzzy: FuzzyConfig | None = None, seed: int | None = None,
                stop: str | Sequence[str] | None = None, chat: bool | None = None, autoregressive: bool = False,
                children: str = "auto", device: torch.device | str | None = None) -> PreparedCall:
        """Check one call's arguments (see ``generate``) and encode its prompt, without decoding: InputError or
        ConfigError for anything this generator cannot run. ``max_new_tokens`` is lowered to what the model's
        context leaves (``clipped`` says so). For servers and tools that run calls on sessions themselves
        (``session_for``, fsd_eagle.schedule). ``device``: where the prompt ids go (default: the target's); a
        thread other than the one that decodes passes "cpu", since a CUDA call from it while the decoding
        thread captures a CUDA graph breaks the capture."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, children=children)
        ids = self.encode(prompt, chat)
        limit = self.target.max_positions
        if len(ids) + self.tree.total_tokens + self.tree.depth + 2 >= limit:
            raise InputError(f"the prompt has {len(ids)} tokens: too long for the model's context of {limit} tokens "
                             f"(a round needs {self.tree.total_tokens + self.tree.depth + 2} more)")
        room = limit - len(ids) - self.tree.total_tokens - self.tree.depth - 2
        clipped = max_new_tokens > room
        max_new_tokens = min(max_new_tokens, room)
        if fuzzy is not None and not isinstance(fuzzy, FuzzyConfig):
            raise ConfigError(f"fuzzy must be a FuzzyConfig or None, got {type(fuzzy).__name__}")
        if seed is not None:
            check_seed(seed)
        if isinstance(stop, str):
            stop = (stop,)
        if stop is not None and (not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop)):
            raise InputError(f"stop must be a string or a list of strings, got {stop!r}")
        prompt_ids = torch.tensor(ids, dtype=torch.long, device=self.target.device if device is None else device)
        return PreparedCall(prompt_ids, max_new_tokens, AcceptanceRule(sampling, fuzzy or FuzzyConfig()),
                     tuple(s for s in (stop or ()) if s), 0 if seed is None else seed,
                     autoregressive or self.drafter is None, clipped)

    def stream(self, prompt: Prompt | Sequence[Prompt], max_new_tokens: int = 256, *, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0, fuzzy: FuzzyConfig | None = None,
               seed: int | Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
               chat: bool | None = None, autoregressive: bool = False, with_result: bool = False,
               batch_size: int | None = None, children: str = "auto") -> Iterator:
        """Yield text pieces as they are accepted, then (only with ``with_result``) the GenerationResult
        with the call's statistics; see ``generate`` for the other arguments. Given a list of prompts,
        yield ``(index, piece)`` pairs instead, pieces of all prompts interleaved as rounds complete (and
        ``(index, result)`` as each ends, with ``with_result``); ``batch_size`` as in ``generate_many``.
        Prompts start shortest first (fsd_eagle.schedule.start_order), not in list order, so with fewer
        rows than prompts the pieces of short prompts tend to come first.

        The call starts at the first ``next()`` and holds the generator until the iterator is exhausted,
        closed or garbage-collected: meanwhile another thread's call waits, and a call from this thread
        raises BusyError (see ``generate``)."""
        many = is_prompt_list(prompt)
        if many:
            calls = self._prepare_many(prompt, max_new_tokens, temperature, top_p, top_k, fuzzy, seed, stop, chat,
                                       autoregressive, batch_size, children)
        else:
            if batch_size is not None:
                raise InputError("batch_size applies to a list of prompts")
            calls = [self.prepare(prompt, max_new_tokens, temperature, top_p, top_k, fuzzy, seed, stop, chat,
                                   autoregressive, children)]
        with self._calls.hold():
            for i, piece in self._decode(calls, self._rows(len(calls), batch_size), streaming=True):
                if with_result or isinstance(piece, str):
                    yield (i, piece) if many else piece

    def generate(self, prompt: Prompt, max_new_tokens: int = 256, *, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, fuzzy: FuzzyConfig | None = None, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, chat: bool | None = None,
                 autoregressive: bool = False, batch_size: int | None = None, children: str = "auto"
                 ) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` tokens after ``prompt``; given a list of prompts (strings, or
        lists of messages or token ids), a list of results in input order (see ``generate_many``).

        temperature 0 is greedy; otherwise top_p / top_k filter the target's distribution. ``fuzzy`` sets
        the FSD rule (default: exact). Generation stops at EOS, at any ``stop`` string (excluded from the
        text) or at max_new_tokens. ``autoregressive`` decodes without a drafter (the baseline).
        ``children`` (sampling): "top" drafts each node's most likely tokens, "sampled" draws them from the
        drafter at the temperature (speculative sampling; for chains of a draft model, top_k 1, it accepts
        more); "auto" (the default) is "sampled" where the call's tree draws children from a pool
        (``TreeConfig.pool``: a preset's sampling tree, or ``set_tree(pool=...)``), else "top"; with the
        exact rule all give the target's distribution; with ``fuzzy`` the first child drawn is the one the
        fuzzy test may accept.

        One call runs at a time (the KV caches and round state are the generator's): a call from another
        thread waits for the running one; a call while this thread's own ``stream`` iterator is unfinished
        raises BusyError, since waiting for it would never end.
        """
        if is_prompt_list(prompt):
            results: list = [None] * len(prompt)
            for i, r in self.generate_many(prompt, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                           fuzzy=fuzzy, seed=seed, stop=stop, chat=chat,
                                           autoregressive=autoregressive, batch_size=batch_size, children=children):
                results[i] = r
            return results
        if batch_size is not None:
            raise InputError("batch_size applies to a list of prompts")
        call = self.prepare(prompt, max_new_tokens, temperature, top_p, top_k, fuzzy, seed, stop, chat, autoregressive,
                             children)
        with self._calls.hold():
            return next(piece for _, piece in self._decode([call], 1) if isinstance(piece, GenerationResult))

    def generate_many(self, prompts: Sequence[Prompt], max_new_tokens: int = 256, *, temperature: float = 0.0,
                      top_p: float = 1.0, top_k: int = 0, fuzzy: FuzzyConfig | None = None,
                      seed: int | Sequence[int] | None = None, stop: str | Sequence[str] | None = None,
                      chat: bool | None = None, autoregressive: bool = False,
                      batch_size: int | None = None, children: str = "auto") -> Iterator[tuple[int, GenerationResult]]:
        """Generate for many prompts; yield ``(index, result)`` as each prompt finishes (completion order,
        ``index`` into ``prompts``). Up to ``batch_size`` prompts (default: all, at most 64) decode together,
        one target forward per round for all of them; a prompt that finishes frees its row for the next one
        waiting (the shortest waiting prompt first). ``seed``: one for every prompt (each result then equals
        ``generate`` of that prompt alone with that seed, up to floating-point differences between batch
        shapes) or one per prompt. Every prompt is checked before the first one runs."""
        calls = self._prepare_many(prompts, max_new_tokens, temperature, top_p, top_k, fuzzy, seed, stop, chat,
                                   autoregressive, batch_size, children)
        with self._calls.hold():
            for i, piece in self._decode(calls, self._rows(len(calls), batch_size)):
                if isinstance(piece, GenerationResult):
                    yield i, piece

    @staticmethod
    def _rows(prompts: int, batch_size: int | None) -> int:
        """Rows that decode together: ``batch_size`` (default: every prompt), at most the largest bucket."""
        return min(batch_size or BUCKETS[-1], prompts, BUCKETS[-1])

    def _prepare_many(self, prompts, max_new_tokens, temperature, top_p, top_k, fuzzy, seed, stop, chat,
                      autoregressive, batch_size, children: str = "auto") -> list[PreparedCall]:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InputError("prompts must be a list of prompts")
        prompts = list(prompts)
        if not prompts:
            raise InputError("the list of prompts is empty")
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size < 1):
            raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(seed, Sequence) and not isinstance(seed, (str, bytes)):
            seeds = list(seed)
            if len(seeds) != len(prompts):
                raise InputError(f"got {len(seeds)} seeds for {len(prompts)} prompts")
        else:
            seeds = [seed] * len(prompts)
        calls = []
        for i, (prompt, s) in enumerate(zip(prompts, seeds)):
            try:
                calls.append(self.prepare(prompt, max_new_tokens, temperature, top_p, top_k, fuzzy, s, stop, chat,
                                           autoregressive, children))
            except InputError as e:
                raise InputError(f"prompt {i}: {e}") from None
        return calls

    def session(self, autoregressive: bool = False, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                fuzzy: FuzzyConfig | None = None, batch: int = 1, children: str = "auto") -> Session:
        """The session that a call with these arguments uses now (same tree, graph and compile settings;
        ``batch`` prompts decoded together: the batch's tree, rows rounded up to a bucket): for tools that time or inspect rounds (its ``graph``,
        ``prefills``, ``state``, ``mode``, ``launch``)."""
        rule = AcceptanceRule(SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, children=children),
                              fuzzy or FuzzyConfig())
        return self._session(not autoregressive, rule, batch)

    def session_for(self, call: PreparedCall, rows: int = 1, compiled: bool | None = None) -> Session:
        """The kept session on which ``call`` decodes among ``rows`` prompts of its rule form (the session
        ``generate`` uses: calls that differ only in rule numbers, seeds or prompts share it). ``compiled``:
        the session with compiled rounds (True) or with graph rounds only (False) whatever ``compile`` says
        (None: as it says), for a driver that decodes on graph rounds while compiled ones are being made."""
        return self._session(not call.autoregressive, call.rule, rows, compiled)

    def forget_session(self, call: PreparedCall, rows: int = 1, compiled: bool | None = None) -> None:
        """Drop the kept session that ``session_for`` gives for these arguments (its caches and captured graphs),
        e.g. one whose making failed halfway: the next ``session_for`` makes it afresh."""
        plan = self._plan(not call.autoregressive, call.rule, rows, compiled)
        with self._sessions_lock:
            self._sessions.pop(plan, None)

    def exclusive(self):
        """A context manager that holds this generator for the calling thread, as a generation call does
        (other threads' calls wait; see ``generate``): for a driver that runs sessions itself."""
        return self._calls.hold()

    def _session(self, drafting: bool, rule: AcceptanceRule, rows: int, compiled: bool | None = None) -> Session:
        """The kept session for ``rows`` prompts under ``rule``: calls that differ only in temperature,
        top-p, top-k, threshold, seed or prompts share one (and its graphs). The tree is the batch's
        (``_batch_tree``: its size's, greedy or sampling)."""
        plan = self._plan(drafting, rule, rows, compiled)
        with self._sessions_lock:  # a server makes compiled sessions on a thread of their own
            if plan not in self._sessions:
                self._sessions[plan] = Session(self.engine, plan)
            return self._sessions[plan]

    def _plan(self, drafting: bool, rule: AcceptanceRule, rows: int, compiled: bool | None = None) -> Plan:
        """The plan of the session ``_session`` keeps for these arguments."""
        tree, drafts = self._batch_tree(rows, not rule.form.greedy)
        drafting = drafting and drafts and self.engine.has_drafter and tree.drafts
        form = rule.form_for(tree) if drafting else rule.form.exact()
        graphs = self._cuda_graphs and self.target.device.type == "cuda"
        compile = self._compile if compiled is None else compiled
        return Plan(tree, form, drafting, graphs, compile and graphs, self._attention, session_rows(rows))

    def _decode(self, calls: list[PreparedCall], rows: int, streaming: bool = False
                ) -> Iterator[tuple[int, str | GenerationResult]]:
        """Decode ``calls`` (one rule form) on ``rows`` rows: yield (index, text piece) as text is accepted
        (with ``streaming``) and (index, GenerationResult) when a call ends."""
        session = self._session(not calls[0].autoregressive, calls[0].rule, rows)
        requests = [Request(c.prompt_ids, c.max_new_tokens, c.rule, c.seed, c.stats) for c in calls]
        outputs = [TextOutput(self.tokenizer, self.eos_ids, c, streaming) for c in calls]
        scheduler = Scheduler(session, requests, rows)
        for i, tokens in scheduler.run():
            for item in outputs[i].take(tokens, scheduler, i):
                yield i, item


class TextOutput:
    """The text of one call as its tokens arrive: ends it at EOS, a stop string or its token budget, and
    (``streaming``) gives the text that can be shown so far, holding back a tail that may still become a
    stop string. Without streaming and stop strings, text is decoded once, at the end."""

    def __init__(self, tokenizer, eos_ids: frozenset, call: PreparedCall, streaming: bool) -> None:
        self.tokenizer, self.eos_ids, self.call, self.streaming = tokenizer, eos_ids, call, streaming
        self.decodes = streaming or bool(call.stop)
        self.tokens: list[int] = []
        self.text = ""  # shown so far
        self.reason = "max_new_tokens"
        self.received = 0

    @property
    def ended(self) -> bool:
        return self.reason != "max_new_tokens" or self.received >= self.call.max_new_tokens

    def add(self, new: list[int]) -> str:
        """Take a round's tokens; returns the text that may be shown now ("" if none)."""
        self.received += len(new)
        for tok in new:
            if tok in self.eos_ids:
                self.reason = "eos"
                break
            self.tokens.append(tok)
        if not self.decodes:
            return ""
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if _first_stop(full, self.call.stop) is not None:
            self.reason = "stop_string"
        if self.ended:
            return ""  # the rest comes with finish()
        visible = full[: len(full) - _stop_prefix_len(full, self.call.stop)]
        if len(visible) > len(self.text) and not visible.endswith("\ufffd"):
            piece, self.text = visible[len(self.text):], visible
            return piece
        return ""

    def take(self, tokens: list[int], scheduler: Scheduler, index: int) -> Iterator[str | GenerationResult]:
        """Take the tokens that ``scheduler`` yielded for this call (its request ``index``): yield the text
        that may be shown now, and once the call has ended (it is then finished on the scheduler) the rest
        of its text (when streaming) and its GenerationResult."""
        piece = self.add(tokens)
        if piece:
            yield piece
        if self.ended:
            scheduler.finish(index)
            piece, result = self.finish()
            if piece and self.streaming:
                yield piece
            yield result

    def finish(self) -> tuple[str, GenerationResult]:
        """The text not yet shown and the call's result."""
        reason = "context" if self.reason == "max_new_tokens" and self.call.clipped else self.reason
        full = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = _first_stop(full, self.call.stop)
        final = full[:cut] if cut is not None else full
        piece = final[len(self.text):] if len(final) > len(self.text) else ""
        self.text = final
        stats = self.call.stats
        stats.new_tokens = len(self.tokens) + (reason == "eos")
        return piece, GenerationResult(final, self.tokens, stats, reason)


def is_prompt_list(prompt) -> bool:
    """Whether ``prompt`` is a list of prompts (items that are strings or lists) rather than one prompt (a
    string, a list of chat messages or a list of token ids)."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence) or not prompt:
        return False
    return all(isinstance(p, (str, list, tuple)) for p in prompt)


def _check_text(text: str, what: str) -> None:
    """Refuse text that is not Unicode (lone surrogates: e.g. bytes of a command line that are not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not valid UTF-8 text (position {e.start})") from None


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class _OneCall:
    """Lets one generation call at a time use a generator's caches: ``hold()`` waits while another thread's
    call runs, and raises BusyError when the running call is this thread's own (an unfinished stream
    iterator: waiting for it would never end)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread that started the running call

    @contextmanager
    def hold(self):
        me = threading.get_ident()
        if self._owner == me:  # only this thread sets its own id, so this read cannot race to a wrong True
            raise BusyError("this generator is already running a call (an unfinished stream?); finish or close "
                            "it first, or use another generator")
        with self._lock:
            self._owner = me
            try:
                yield
            finally:
                self._owner = None


_DEFAULT: SpeculativeGenerator | None = None
_DEFAULT_LOCK = threading.Lock()


def generate(prompt: Prompt, max_new_tokens: int = 256, **kwargs) -> GenerationResult:
    """One-call API on the default model and its shipped head (loaded once, on the best device)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = SpeculativeGenerator.load()
    return _DEFAULT.generate(prompt, max_new_tokens, **kwargs)
