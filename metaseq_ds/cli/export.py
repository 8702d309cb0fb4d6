"""`mseq export hf CKPT OUT`: the thin command around `metaseq_ds.convert.hf_export`."""

import sys
from pathlib import Path


def hf(checkpoint: str, out: str, dtype: str, max_shard_size: str) -> None:
    from metaseq_ds.convert.hf_export import export_hf

    notes = export_hf(checkpoint, out, dtype=dtype, max_shard_size=max_shard_size)
    for note in notes:
        print(f"mseq export hf: note: {note}", file=sys.stderr)
    files = sorted(p.name for p in Path(out).iterdir())
    print(f"wrote {out}: {', '.join(files)}")
    print(f"load:  OPTForCausalLM.from_pretrained({str(out)!r})")
