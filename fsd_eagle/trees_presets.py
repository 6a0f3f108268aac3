"""Tree presets: the tuned (total_tokens, depth, top_k) for a target on a device type, from trees/presets.json
when it is shipped next to the package, else the EAGLE-2 defaults."""

from __future__ import annotations

import json
from pathlib import Path

from .config import TreeConfig
from .target import Target

PRESETS = Path(__file__).parent / "tree_presets.json"


def preset_tree(target: Target) -> TreeConfig:
    """The preset for this target's model name and device type, or TreeConfig() defaults."""
    if not PRESETS.exists():
        return TreeConfig()
    table = json.loads(PRESETS.read_text())
    name = str(getattr(target.config, "_name_or_path", "")).rstrip("/").split("/")[-1]
    entry = table.get(name, {}).get(target.device.type) or table.get("*", {}).get(target.device.type)
    return TreeConfig(**entry["tree"]) if entry else TreeConfig()
