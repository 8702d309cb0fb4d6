"""Run the benchmarks one after another and print each one's table: `python -m benchmarks [NAME ...]`.

    python -m benchmarks                  # peak, train, generate, migrate (~13 minutes on 2 cores)
    python -m benchmarks train --quick    # one benchmark; arguments after the name go to it
    python -m benchmarks cli_startup export_memory

Each benchmark runs in a fresh process (`python -m benchmarks.NAME`), so none inherits
another's threads, memory or imported libraries.
"""

import subprocess
import sys
import time
from pathlib import Path

DEFAULT = ("peak", "train", "generate", "migrate")
OTHERS = ("cli_startup", "export_memory", "profile_train", "serve", "zero0_step")
ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    names, extra = list(DEFAULT), []
    if len(sys.argv) > 1:
        known = [arg for arg in sys.argv[1:] if arg in DEFAULT + OTHERS]
        if not known:
            sys.exit(f"usage: python -m benchmarks [NAME ...] [ARGS]; names: {', '.join(DEFAULT + OTHERS)}")
        names = known
        extra = [arg for arg in sys.argv[1:] if arg not in known] if len(known) == 1 else []
    start = time.perf_counter()
    failed = []
    for name in names:
        print(f"\n=== {name} " + "=" * (60 - len(name)), flush=True)
        began = time.perf_counter()
        code = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *extra], cwd=ROOT).returncode
        print(f"--- {name}: {time.perf_counter() - began:.0f} s" + (f", exit code {code}" if code else ""), flush=True)
        if code:
            failed.append(name)
    outcome = f"; failed: {', '.join(failed)}" if failed else ""
    print(f"\nall benchmarks: {time.perf_counter() - start:.0f} s{outcome}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
