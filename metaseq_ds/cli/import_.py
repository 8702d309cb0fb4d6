"""`mseq import hf HF_DIR OUT` and `mseq import metaseq CKPT OUT`: thin commands around `metaseq_ds.convert`.

(The module is `import_` because `import` is a Python keyword.)
"""

import sys
from typing import List, Optional


def hf(hf_dir: str, out: str) -> None:
    from metaseq_ds.convert.hf_import import import_hf

    _report("hf", import_hf(hf_dir, out), out)


def metaseq(checkpoint: str, out: str, hf_tokenizer: Optional[str], vocab_filename: Optional[str],
            merges_filename: Optional[str]) -> None:
    from metaseq_ds.convert.metaseq_import import import_metaseq

    _report("metaseq", import_metaseq(checkpoint, out, hf_tokenizer, vocab_filename, merges_filename), out)


def _report(source: str, notes: List[str], out: str) -> None:
    for note in notes:
        print(f"mseq import {source}: note: {note}", file=sys.stderr)
    print(f"wrote {out} (weights only; starts at update 0)")
    print(f"validate:  mseq validate --path {out} --data DATA")
    print(f"train:     mseq train DATA --restore-file {out} (with the model's flags) ...")
