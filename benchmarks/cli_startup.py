"""How long `mseq --help` takes, as a user runs it (the console script, a fresh process).

    python benchmarks/cli_startup.py [--runs 10]

Prints the median and best wall time of `mseq --help` and, for scale, of `python -c pass`
and `python -c "import torch"`. Target: `mseq --help` under 0.5 s.
"""

import argparse
import shutil
import statistics
import subprocess
import sys
import time


def wall_times(cmd, runs):
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    mseq = shutil.which("mseq") or sys.exit("mseq is not on PATH: pip install -e . first")
    rows = [
        ("python -c pass", [sys.executable, "-c", "pass"]),
        ("mseq --help", [mseq, "--help"]),
        ("python -c 'import torch'", [sys.executable, "-c", "import torch"]),
    ]
    print(f"{'command':<28} {'median s':>9} {'best s':>8}")
    results = {}
    for name, cmd in rows:
        times = wall_times(cmd, args.runs)
        results[name] = statistics.median(times)
        print(f"{name:<28} {statistics.median(times):>9.3f} {min(times):>8.3f}")
    verdict = "meets" if results["mseq --help"] < 0.5 else "misses"
    print(f"summary: mseq --help median {results['mseq --help']:.3f} s ({verdict} the 0.5 s target)")


if __name__ == "__main__":
    main()
