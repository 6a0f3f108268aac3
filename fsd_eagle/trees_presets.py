"""Tree presets: the tuned draft tree (total_tokens, depth, top_k[, draft_vocab]) for a target on a device
type, and per batch size.

The presets are package data, ``fsd_eagle/presets.json`` (written by ``python -m trees.tune`` in a source
checkout), read with ``importlib.resources`` so that an installed wheel finds them as a checkout does. For a
target / device type the file does not name, the answer is the EAGLE-2 defaults, ``TreeConfig()``.

File layout::

    {"_shapes": {"chain-6": {"total_tokens": 7, "depth": 6, "top_k": 1}, ...},
     "<model name>": {"<device type>": {
         "tree": {"total_tokens": ..., "depth": ..., "top_k": ...[, "draft_vocab": ...]} or "<shape name>",
         "measured": {...how it was chosen...},
         "sampling": {"tree": {...} or "<shape name>", "measured": {...}},
         "batch": {"8":  {"tree": {...} or "<shape name>", "measured": {...}},
                   "32": {"tree": "autoregressive", "measured": {...}}}}},
     "*": {...same, for any model...}}

Keys that begin with "_" are not model names. A model's name is the last part of its folder (or hub id),
``config._name_or_path``; the device type is "cpu" or "cuda".

Batch buckets. The best tree depends on how many prompts are decoded together: a large batch makes the
target's verify forward compute-bound, so smaller trees, or no drafting at all, win. The optional "batch"
object maps a bucket (a power of two, 2 to 64, as a string) to an entry of its own; its "tree" may also be
"autoregressive": decoding without a drafter measured fastest there. A batch of B prompts uses the entry of
the largest bucket <= B; the device entry's own "tree" is bucket 1, used below the smallest bucket (and for
any batch size when there is no "batch" object, as in files written before buckets existed). A device entry
may hold only "batch"; its bucket 1 is then the EAGLE-2 defaults.

Sampling. An entry (the device entry, or a bucket's) may hold "sampling": {"tree": ..., "measured": ...}, the
tree of calls that sample (temperature > 0) at that bucket; greedy calls use "tree", and so do sampling calls
where there is no "sampling" object. When sampling, a target's sample rarely follows a branch to its deepest
nodes, so a shallower tree, which drafts fewer levels per round, can be the faster one
(``python -m trees.tune --trees ... --temperature T`` measures it).
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from .config import OPTIONAL_TREE_KEYS, TreeConfig
from .errors import ConfigError, InputError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

    from .target import Target

#: fsd_eagle/presets.json, the package's own data file (found the same way in a checkout and in a wheel).
PRESETS: "Traversable | Path" = resources.files(__package__) / "presets.json"
TREE_KEYS = ("total_tokens", "depth", "top_k")
#: The batch buckets a "batch" object may name; bucket 1 is the device entry's own "tree".
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: The "tree" of a batch entry where decoding without a drafter measured fastest.
AUTOREGRESSIVE = "autoregressive"


@dataclasses.dataclass(frozen=True)
class Preset:
    """A preset as decoding uses it.

    tree: the draft tree. For an autoregressive preset, the tree of the nearest smaller bucket that drafts
        (else the device entry's, else the defaults): what to draft with if drafting anyway.
    autoregressive: decoding without a drafter measured fastest for this batch size.
    bucket: the batch bucket the entry was filed under (1: the device entry's own tree); None for the
        defaults (no entry for this model and device type).
    """

    tree: TreeConfig = TreeConfig()
    autoregressive: bool = False
    bucket: int | None = None


def model_name(config) -> str:
    """The name presets are filed under: the last part of ``config._name_or_path`` ("" when unknown)."""
    return str(getattr(config, "_name_or_path", "") or "").replace("\\", "/").rstrip("/").split("/")[-1]


def load_presets(path: "str | Path | Traversable | None" = None) -> dict:
    """The presets table ({} when the file does not exist); a malformed file raises ConfigError."""
    path = PRESETS if path is None else (Path(path) if isinstance(path, str) else path)
    if not path.is_file():
        return {}
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the tree presets {path}: {e}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"the tree presets {path} must hold a JSON object")
    if not isinstance(table.get("_shapes", {}), dict):
        raise ConfigError(f"the tree presets {path}: \"_shapes\" must be an object of named trees")
    return table


def tree_from_spec(spec, table: dict) -> TreeConfig:
    """A TreeConfig from a preset's "tree": a {total_tokens, depth, top_k} object or a shape name."""
    if isinstance(spec, str):
        shapes = table.get("_shapes", {})
        if not isinstance(shapes, dict):
            raise ConfigError("the tree presets' \"_shapes\" must be an object of named trees")
        if spec not in shapes or isinstance(shapes[spec], str):
            raise ConfigError(f"unknown tree shape {spec!r} in the tree presets")
        spec = shapes[spec]
    if not isinstance(spec, dict) or not set(TREE_KEYS) <= set(spec) <= set(TREE_KEYS) | set(OPTIONAL_TREE_KEYS):
        raise ConfigError(f"a tree preset needs exactly {', '.join(TREE_KEYS)} (and optionally "
                          f"{' and '.join(OPTIONAL_TREE_KEYS)}); got {spec!r}")
    return TreeConfig(**spec)


def named_shape(name: str, path: "str | Path | Traversable | None" = None) -> TreeConfig:
    """A named shape of the presets file (e.g. "chain-6", "eagle2-default")."""
    return tree_from_spec(name, load_presets(path))


def batch_bucket(batch_size: int) -> int:
    """The largest bucket (power of two, 1 to 64) <= ``batch_size``; InputError below 1 or for a non-integer."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    return max(b for b in BUCKETS if b <= batch_size)


def bucket_entries(device_entry: dict) -> dict[int, dict]:
    """A device entry's "batch" object as {bucket: entry}; a malformed one raises ConfigError."""
    batch = device_entry.get("batch", {})
    if not isinstance(batch, dict):
        raise ConfigError(f"a preset's \"batch\" must map buckets to entries; got {batch!r}")
    out = {}
    for key, entry in batch.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) in BUCKETS[1:]):
            raise ConfigError(f"a preset's batch bucket must be one of {', '.join(map(str, BUCKETS[1:]))}; "
                              f"got {key!r} (bucket 1 is the device entry's own tree)")
        if not isinstance(entry, dict) or "tree" not in entry:
            raise ConfigError(f"the preset for batch bucket {key} needs a \"tree\"; got {entry!r}")
        out[int(key)] = entry
    return out


def _device_entry(table: dict, key: str, device_type: str) -> dict | None:
    if not key or key.startswith("_"):
        return None
    entry = table.get(key)
    found = entry.get(device_type) if isinstance(entry, dict) else None
    return found if isinstance(found, dict) and ("tree" in found or "batch" in found or "sampling" in found) else None


def _tree_spec(entry: dict, sampling: bool, where: str):
    """An entry's "tree", or with ``sampling`` its "sampling" object's tree where it has one; a malformed
    "sampling" object raises ConfigError (whatever ``sampling`` is)."""
    spec = entry.get("sampling")
    if spec is not None and not (isinstance(spec, dict) and "tree" in spec):
        raise ConfigError(f"the \"sampling\" preset of {where} needs a \"tree\"; got {spec!r}")
    return spec["tree"] if sampling and spec is not None else entry.get("tree")


def lookup_preset(table: dict, name: str, device_type: str, batch_size: int = 1, sampling: bool = False
                  ) -> Preset | None:
    """The preset for a model name, device type and batch size in ``table`` (the "*" model's when the model
    has no entry for the device type), or None: the entry of the largest batch bucket <= ``batch_size``,
    else the device entry's own tree (the defaults where it has none). ``sampling``: the tree of calls
    that sample, where an entry has one ("sampling"), else the same tree as greedy calls."""
    bucket = batch_bucket(batch_size)
    entry = next((e for e in (_device_entry(table, key, device_type) for key in (name, "*")) if e is not None), None)
    if entry is None:
        return None
    device_tree = _tree_spec(entry, sampling, "the device entry")
    if AUTOREGRESSIVE in (entry.get("tree"), device_tree):
        raise ConfigError(f"only a batch bucket's preset may be {AUTOREGRESSIVE!r}; the device entry's own tree "
                          "is for single prompts")
    buckets = bucket_entries(entry)
    levels = [(b, _tree_spec(buckets[b], sampling, f"batch bucket {b}")) for b in sorted(buckets, reverse=True)
              if b <= bucket]
    levels.append((1, device_tree))  # None: the defaults
    chosen = levels[0][0]
    # The chosen bucket's tree; where that is autoregressive, the nearest smaller bucket's that drafts
    # (bucket 1, last, is taken whatever it holds: it is never "autoregressive").
    for b, spec in levels:
        if spec == AUTOREGRESSIVE:
            continue
        tree = TreeConfig() if spec is None else tree_from_spec(spec, table)
        if tree.drafts or b == 1:
            break
    return Preset(tree, b != chosen or not tree.drafts, chosen)


def lookup(table: dict, name: str, device_type: str, batch_size: int = 1) -> TreeConfig | None:
    """The tree of ``lookup_preset`` (total_tokens 1, i.e. no drafting, where the preset is autoregressive),
    or None."""
    found = lookup_preset(table, name, device_type, batch_size)
    return None if found is None else as_tree(found)


def as_tree(found: Preset) -> TreeConfig:
    """A preset as one TreeConfig: its tree, or total_tokens 1 (no drafting) where it is autoregressive."""
    return TreeConfig(total_tokens=1, depth=1, top_k=1) if found.autoregressive else found.tree


def preset(target: "Target", path: "str | Path | Traversable | None" = None, *, batch_size: int = 1,
           sampling: bool = False) -> Preset:
    """The preset for this target's model name and device type and ``batch_size`` prompts decoded together
    (``sampling``: for calls that sample), or ``Preset()`` (the TreeConfig() defaults, drafting)."""
    config = getattr(getattr(target, "model", None), "config", None) or target.config  # a text sub-config has no name
    return preset_entry(model_name(config), target.device.type, path, batch_size=batch_size, sampling=sampling)


def preset_tree(target: "Target", path: "str | Path | Traversable | None" = None, *, batch_size: int = 1) -> TreeConfig:
    """The preset tree for this target's model name, device type and batch size, or TreeConfig() defaults;
    where the batch's preset is autoregressive, a tree of total_tokens 1 (see ``preset`` for both parts)."""
    return as_tree(preset(target, path, batch_size=batch_size))


def preset_entry(name: str, device_type: str, path: "str | Path | Traversable | None" = None, *,
                 batch_size: int = 1, sampling: bool = False) -> Preset:
    """The preset filed under a model name and device type for ``batch_size`` (and ``sampling``), or
    ``Preset()``."""
    found = lookup_preset(load_presets(path), name, device_type, batch_size, sampling)
    return found if found is not None else Preset()


def preset_for(name: str, device_type: str, path: "str | Path | Traversable | None" = None, *,
               batch_size: int = 1) -> TreeConfig:
    """The preset tree filed under a model name and device type (``as_tree``), or TreeConfig() defaults."""
    return as_tree(preset_entry(name, device_type, path, batch_size=batch_size))


def with_overrides(base: TreeConfig, total_tokens: int | None = None, depth: int | None = None,
                   top_k: int | None = None, draft_vocab: int | None = None, pool: int | None = None) -> TreeConfig:
    """``base`` with every value given here (not None) replacing its own."""
    given = {"total_tokens": total_tokens, "depth": depth, "top_k": top_k, "draft_vocab": draft_vocab, "pool": pool}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
