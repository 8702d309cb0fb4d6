"""`mseq reshard CKPT OUT --ranks N --tensor-parallel-size T [--zero-stage S]`: the thin command
around `metaseq_ds.checkpoint.reshard`."""

from typing import Optional


def main(checkpoint: str, out: str, ranks: int, tensor_parallel_size: int, zero_stage: Optional[int]) -> None:
    from metaseq_ds.checkpoint.reshard import reshard

    written = reshard(checkpoint, out, ranks, tensor_parallel_size, zero_stage)
    print(f"wrote {written}")
    print(f"resume:  mseq train ... --restore-file {out}   (on {ranks} rank(s), tensor-parallel {tensor_parallel_size})")
