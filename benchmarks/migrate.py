"""Speed of `mseq migrate` on a 400-file tree of fairseq-style plugin code (target: < 30 s on 2 cores).

    python benchmarks/migrate.py [--files 400] [--jobs N]      (or python -m benchmarks.migrate)

Every file needs migrating (the worst case: files that never mention fairseq are not even
parsed): the fixture plugin of tests/plugins, grown to ~150 lines with more fairseq-style code.
Prints files/s for one process and for --jobs processes (default: the machine's cores).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `migrate` package it measures.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from migrate import runner  # noqa: E402

PLUGIN = Path(__file__).resolve().parent.parent / "tests" / "plugins" / "fairseq_style_plugin" / "__init__.py"
EXTRA = '''

def helper_{i}(model, sample):
    """More plugin code, the kind that reads fairseq names through a module."""
    import fairseq.models as fm
    if isinstance(model, fm.FairseqDecoder):
        out = model.decoder(sample["net_input"]["src_tokens"])
    else:
        out = model(**sample["net_input"])
    values = [x * 2 for x in range(10) if x % 3]
    total = sum(values) + len(out)
    return {{"total": total, "name": "helper_{i}"}}
'''


def build_tree(root: Path, files: int) -> None:
    text = PLUGIN.read_text() + "".join(EXTRA.format(i=i) for i in range(4))
    for i in range(files):
        folder = root / f"pkg{i // 50}"
        folder.mkdir(exist_ok=True)
        (folder / f"module_{i}.py").write_text(text)


def timed(files: int, jobs: int) -> float:
    root = Path(tempfile.mkdtemp(prefix="mseq-migrate-bench-"))
    try:
        build_tree(root, files)
        start = time.perf_counter()
        code = runner.run(runner.Options([str(root)], jobs=jobs))
        seconds = time.perf_counter() - start
        assert code == 0, code
        return seconds
    finally:
        shutil.rmtree(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    lines = len(PLUGIN.read_text().splitlines()) + 4 * len(EXTRA.splitlines())
    print(f"tree: {args.files} files of {lines} lines, every one migrated", file=sys.stderr)
    for jobs in sorted({1, args.jobs}):
        seconds = timed(args.files, jobs)
        print(f"mseq migrate -j {jobs}: {args.files} files in {seconds:.1f} s = {args.files / seconds:.1f} files/s")


if __name__ == "__main__":
    main()
