"""`mseq migrate` on fairseq 0.12.2's own published source: a realistic corpus, outside the unit suite.

Skipped unless MSEQ_FAIRSEQ_SRC names the unzipped wheel (a folder holding fairseq/ and fairseq_cli/):

    pip download fairseq==0.12.2 --no-deps --only-binary :all: --python-version 3.8 \
        --platform manylinux1_x86_64 -d /tmp/fq && unzip -q /tmp/fq/*.whl -d /tmp/fq/src
    MSEQ_FAIRSEQ_SRC=/tmp/fq/src python -m pytest tests/test_migrate_fairseq.py -s
"""

import importlib
import os
import shutil
import time
from pathlib import Path

import libcst as cst
import pytest

from migrate import runner

SOURCE = os.environ.get("MSEQ_FAIRSEQ_SRC")
pytestmark = pytest.mark.skipif(not SOURCE, reason="set MSEQ_FAIRSEQ_SRC to an unzipped fairseq wheel")


def _parses(path: Path) -> bool:
    try:
        cst.parse_module(path.read_text(encoding="utf-8"))
        return True
    except (cst.ParserSyntaxError, UnicodeDecodeError):
        return False


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for part in parts[end:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def test_fairseq_source_migrates_parses_and_is_stable(tmp_path):
    for package in ("fairseq", "fairseq_cli"):
        shutil.copytree(Path(SOURCE) / package, tmp_path / package, ignore=shutil.ignore_patterns("*.so"))
    files = sorted(tmp_path.rglob("*.py"))
    parsed_before = {p for p in files if _parses(p)}
    report = tmp_path / "report.json"
    start = time.perf_counter()
    code = runner.run(runner.Options([str(tmp_path)], report=str(report), jobs=2))
    seconds = time.perf_counter() - start
    items = __import__("json").loads(report.read_text())
    failed = {i["file"] for i in items if i["kind"] == "failure"}
    assert code == (3 if failed else 0)
    assert failed == {str(p) for p in files if p not in parsed_before}  # only files that never parsed fail
    assert {p for p in files if _parses(p)} == parsed_before  # every file still parses
    assert runner.run(runner.Options([str(tmp_path)], check=True, jobs=2)) == (3 if failed else 0)  # a second run changes nothing
    rewritten = [i for i in items if i["kind"] == "import"]
    new_targets = {t.strip().rstrip("*").rstrip(".") for i in rewritten for t in i["new"].split(",")}
    unresolvable = sorted(t for t in new_targets if not _resolves(t))
    assert unresolvable == []
    changed = sum(1 for i in {i["file"] for i in rewritten})
    print(f"\nfairseq 0.12.2: {len(files)} files in {seconds:.1f}s, {changed} changed, {len(rewritten)} imports rewritten "
          f"({len(new_targets)} distinct targets, all resolve), {sum(i['kind'] == 'rename' for i in items)} renames, "
          f"{sum(i['kind'] in ('unresolved', 'string', 'star_import') for i in items)} items need attention, {len(failed)} failed")
