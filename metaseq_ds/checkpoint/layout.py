"""How a run's (or a checkpoint's) model and optimizer are split over ranks: the `Layout`,
which decides whether DeepSpeed reloads its own files (same layout) or the checkpoint is
resharded (`checkpoint.manager`)."""

from dataclasses import dataclass
from typing import Any, Dict


@dataclass(frozen=True)
class Layout:
    """How a run's (or a checkpoint's) model and optimizer are split over ranks."""

    world_size: int
    zero_stage: int
    tensor_parallel_size: int
    precision: str = "fp32"  # "fp32", "bf16" or "fp16": the parameters' dtype (master weights are fp32)
    # ZeRO-1/2: the most parameters an optimizer group holds (0: one group), which DeepSpeed's
    # files are cut by (`deepspeed_config.optimizer_group_limit`); saves before it: one group.
    optimizer_group_limit: int = 0

    @classmethod
    def of_run(cls, cfg, world_size: int) -> "Layout":
        from metaseq_ds.distributed.deepspeed_config import (
            accelerator_traits, build_deepspeed_config, optimizer_group_limit, training_precision)
        from metaseq_ds.distributed.tensor_parallel import tensor_parallel_size

        ds_config = build_deepspeed_config(cfg, world_size, **accelerator_traits())
        return cls(world_size, ds_config["zero_optimization"]["stage"], tensor_parallel_size(cfg), training_precision(ds_config),
                   optimizer_group_limit(ds_config, cfg.model))

    @classmethod
    def of_checkpoint(cls, meta: Dict[str, Any]) -> "Layout":
        common = meta["config"].get("common", {})
        # Saves before the precision was recorded: the flags (fp16 fell back to bf16 on a CPU).
        precision = meta.get("precision") or ("bf16" if common.get("bf16") or common.get("fp16") else "fp32")
        return cls(meta["world_size"], meta["zero_stage"], meta.get("tensor_parallel_size", 1), precision,
                   meta.get("optimizer_group_limit", 0))

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.tensor_parallel_size

    def same_state_as(self, other: "Layout") -> bool:
        """Whether DeepSpeed's own files of one layout load into the other as they are
        (ZeRO-0 keeps whole copies, so any rank count of it loads the same files)."""
        if (self.tensor_parallel_size, self.precision) != (other.tensor_parallel_size, other.precision):
            return False
        return self == other or self.zero_stage == other.zero_stage == 0

    def __str__(self) -> str:
        tp = f" (tensor-parallel {self.tensor_parallel_size})" if self.tensor_parallel_size > 1 else ""
        precision = f" in {self.precision}" if self.precision != "fp32" else ""
        groups = f", optimizer groups of at most {self.optimizer_group_limit:,} parameters" if self.optimizer_group_limit else ""
        return f"{self.world_size} rank(s){tp} with ZeRO-{self.zero_stage}{precision}{groups}"
