"""Models materialised shard by shard hold the dtype they train in: ZeRO-3 partitions are made
in bf16 under --bf16 (zero.Init(module=...) keeps the dtype it is given).

The build runs in a child process (one rank: DeepSpeed needs a process group, which the rest of
the test session should not inherit).
"""

import dataclasses
import json
import subprocess
import sys

from launch import env

TINY = ["/data", "--arch", "transformer_lm_gpt2_tiny", "--decoder-attention-heads", "4", "--tokens-per-sample", "32",
        "--zero-stage", "3"]


def partition_dtypes(precision_flags) -> dict:
    from metaseq_ds import tasks
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.deepspeed_config import build_deepspeed_config
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.models.initialization import InitialValues
    from metaseq_ds.options import parse_train_config

    dist_utils.init_distributed()
    cfg = parse_train_config(TINY + precision_flags)
    task = tasks.setup_task(dataclasses.replace(cfg.task, data=None))
    ds_config = build_deepspeed_config(cfg, 1, fp16_supported=False, overlaps_communication=False)
    model = build_model(cfg, task, None, lambda m: InitialValues(m, m.init_seed), ds_config)
    return {name: str(param.ds_tensor.dtype) for name, param in model.named_parameters()}


def test_zero3_partitions_are_made_in_the_training_dtype():
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    fp32, bf16 = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(fp32.values()) == {"torch.float32"}
    assert set(bf16.values()) == {"torch.bfloat16"} and bf16.keys() == fp32.keys()


if __name__ == "__main__":
    print(json.dumps([partition_dtypes([]), partition_dtypes(["--bf16"])]))


def test_a_ranks_part_owns_its_storage_whatever_the_dimension():
    """A view of the whole tensor would keep all of it alive beside the parameter."""
    import torch

    from metaseq_ds.models.initialization import rank_part

    whole = torch.arange(24.0).view(6, 4)
    for dim in (0, 1):
        part = rank_part(whole, dim, 1, 2)
        assert torch.equal(part, whole.chunk(2, dim=dim)[1]) and part.is_contiguous()
        assert part.untyped_storage().nbytes() == part.numel() * part.element_size()
    assert rank_part(whole, None, 0, 2) is whole and rank_part(whole, 0, 0, 1) is whole
