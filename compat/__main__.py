"""Run a script or module with the compat import hook installed, for code you cannot edit.

    python -m compat train_my_model.py --flag value
    python -m compat -m fairseq_cli.train DATA --arch ...    # fairseq's entry point, on metaseq_ds
"""

import os
import runpy
import sys

import compat
from metaseq_ds.errors import UsageError


def main(argv) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    try:
        compat.install(force=os.environ.get(compat.ENV_VAR, "").strip().lower() == "force")
    except UsageError as error:
        print(f"python -m compat: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if argv[0] == "-m":
        if len(argv) < 2:
            print("python -m compat: error: -m needs a module name", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
