"""Packaging: one copy of the DeepSpeed presets (top-level `ds_configs/`), which the installed
package reads as `metaseq_ds.ds_configs`; every package directory is listed in pyproject.toml."""

import importlib.resources
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from metaseq_ds.distributed.deepspeed_config import PRESETS, load_preset

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(d.relative_to(ROOT).parts) for top in ("metaseq_ds", "compat", "migrate")
             for d in [ROOT / top, *(ROOT / top).rglob("*")] if (d / "__init__.py").is_file()}
    assert listed - {"metaseq_ds.ds_configs"} == found


def test_the_package_reads_the_top_level_presets():
    files = {p.name: p.read_text() for p in (ROOT / "ds_configs").glob("*.json")}
    assert sorted(name[: -len(".json")] for name in files) == sorted(PRESETS)
    package = importlib.resources.files("metaseq_ds.ds_configs")
    for name, text in files.items():
        assert package.joinpath(name).read_text() == text
        assert load_preset(name[: -len(".json")]) == json.loads(text)


def test_the_wheel_ships_the_top_level_presets(tmp_path):
    source = tmp_path / "source"  # a copy: building writes build/ and egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "metaseq_ds", "compat", "migrate", "ds_configs"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copyfile(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = tmp_path.glob("metaseq_ds-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = {Path(name).name: archive.read(name).decode() for name in archive.namelist()
                   if name.startswith("metaseq_ds/ds_configs/") and name.endswith(".json")}
    assert shipped == {p.name: p.read_text() for p in (ROOT / "ds_configs").glob("*.json")}
