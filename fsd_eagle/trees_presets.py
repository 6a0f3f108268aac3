"""Tree presets: the tuned (total_tokens, depth, top_k[, draft_vocab]) for a target on a device type.

The presets are data in the source checkout, ``trees/presets.json`` (written by ``python -m trees.tune``);
the package reads that file at run time when it is installed from a checkout (editable install, as in the
README). Installed without the checkout, or for a target / device type the file does not name, the
answer is the EAGLE-2 defaults, ``TreeConfig()``.

File layout::

    {"_shapes": {"chain-6": {"total_tokens": 7, "depth": 6, "top_k": 1}, ...},
     "<model name>": {"<device type>": {"tree": {"total_tokens": ..., "depth": ..., "top_k": ...[, "draft_vocab": ...]}
                                                 or "<shape name>",
                                        "measured": {...how it was chosen...}}},
     "*": {...same, for any model...}}

Keys that begin with "_" are not model names. A model's name is the last part of its folder (or hub id),
``config._name_or_path``; the device type is "cpu" or "cuda".
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .config import TreeConfig
from .errors import ConfigError
from .target import Target

#: trees/presets.json of the source checkout this package lives in (absent in a plain install).
PRESETS = Path(__file__).resolve().parents[1] / "trees" / "presets.json"
TREE_KEYS = ("total_tokens", "depth", "top_k")


def model_name(config) -> str:
    """The name presets are filed under: the last part of ``config._name_or_path`` ("" when unknown)."""
    return str(getattr(config, "_name_or_path", "") or "").replace("\\", "/").rstrip("/").split("/")[-1]


def load_presets(path: str | Path | None = None) -> dict:
    """The presets table ({} when the file does not exist); a malformed file raises ConfigError."""
    path = Path(path) if path is not None else PRESETS
    if not path.is_file():
        return {}
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the tree presets {path}: {e}") from None
    if not isinstance(table, dict):
        raise ConfigError(f"the tree presets {path} must hold a JSON object")
    return table


def tree_from_spec(spec, table: dict) -> TreeConfig:
    """A TreeConfig from a preset's "tree": a {total_tokens, depth, top_k} object or a shape name."""
    if isinstance(spec, str):
        shapes = table.get("_shapes", {})
        if spec not in shapes or isinstance(shapes[spec], str):
            raise ConfigError(f"unknown tree shape {spec!r} in the tree presets")
        spec = shapes[spec]
    if not isinstance(spec, dict) or not set(TREE_KEYS) <= set(spec) <= set(TREE_KEYS) | {"draft_vocab"}:
        raise ConfigError(f"a tree preset needs exactly {', '.join(TREE_KEYS)} (and optionally draft_vocab); got {spec!r}")
    return TreeConfig(**spec)


def named_shape(name: str, path: str | Path | None = None) -> TreeConfig:
    """A named shape of the presets file (e.g. "chain-6", "eagle2-default")."""
    return tree_from_spec(name, load_presets(path))


def lookup(table: dict, name: str, device_type: str) -> TreeConfig | None:
    """The preset for a model name and device type in ``table`` (the "*" entry as a fallback), or None."""
    for key in (name, "*"):
        if not key or key.startswith("_"):
            continue
        entry = table.get(key)
        if isinstance(entry, dict) and isinstance(entry.get(device_type), dict) and "tree" in entry[device_type]:
            return tree_from_spec(entry[device_type]["tree"], table)
    return None


def preset_tree(target: Target, path: str | Path | None = None) -> TreeConfig:
    """The preset for this target's model name and device type, or TreeConfig() defaults."""
    config = getattr(getattr(target, "model", None), "config", None) or target.config  # a text sub-config has no name
    return preset_for(model_name(config), target.device.type, path)


def preset_for(name: str, device_type: str, path: str | Path | None = None) -> TreeConfig:
    """The preset filed under a model name and device type, or TreeConfig() defaults."""
    found = lookup(load_presets(path), name, device_type)
    return found if found is not None else TreeConfig()


def with_overrides(base: TreeConfig, total_tokens: int | None = None, depth: int | None = None,
                   top_k: int | None = None, draft_vocab: int | None = None) -> TreeConfig:
    """``base`` with every value given here (not None) replacing its own."""
    given = {"total_tokens": total_tokens, "depth": depth, "top_k": top_k, "draft_vocab": draft_vocab}
    return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
