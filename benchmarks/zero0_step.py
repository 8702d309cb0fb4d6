"""ZeRO-0's bf16/fp16 optimizer step: DeepSpeed's own against the one `mseq train` runs.

    python -m benchmarks.zero0_step [--device cuda] [--dtype bf16] [--layers 24 --dim 2048 --heads 32 --ffn 8192]

DeepSpeed steps ZeRO-0 in bf16 or fp16 through `FP16_UnfusedOptimizer`, which asks each gradient
in turn whether it holds an inf or NaN (a read of the device each: a host sync per parameter
on a GPU) and takes each norm from another fp32 copy; `optim.zero_step.lean_zero_step` makes it
read the device once. This builds the training benchmark's model as `mseq train` does (the
`Trainer`, so the step is the one training runs), gives every parameter a fixed random gradient
and times the wrapper's `step()` both ways, in turns, median of `--steps`; each way's device
reads and aten operations (about the kernels it launches) are counted in one more step.
Defaults: OPT-1.3b's shape on a GPU, the training benchmark's (51 M parameters) on the CPU.
"""

import argparse
import statistics
import time
from collections import Counter
from types import SimpleNamespace
from typing import Callable, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.train_worker import RandomTokensTask, train_flags


class CountedOps(TorchDispatchMode):
    """The aten operations run inside it, by name; `_local_scalar_dense` is a read of the device."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def timed(step: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def build_trainer(args):
    """`mseq train`'s construction at the benchmark's shape, ZeRO-0 in `args.dtype`, one process."""
    from metaseq_ds import criterions
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.deepspeed_config import accelerator_traits, build_deepspeed_config
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.models.initialization import InitialValues
    from metaseq_ds.options import parse_train_config
    from metaseq_ds.trainer import Trainer

    dist_utils.init_distributed()
    flags = SimpleNamespace(**{**vars(args), "seq": 8, "batch": 1, "zero_stage": 0, "adam_impl": "auto",
                               "compile_layers": False, "dtype": "bf16" if args.dtype == "bf16" else "fp32"})
    cfg = parse_train_config(train_flags(flags) + (["--fp16"] if args.dtype == "fp16" else []))
    # bf16 on any CPU: the step's cost does not depend on the CPU's bf16 matmul kernels
    traits = {**accelerator_traits(), "bf16_matmul": True}
    ds_config = build_deepspeed_config(cfg, 1, **traits)
    task = RandomTokensTask(cfg.task)
    criterion = criterions.build_criterion(cfg.criterion, task)
    model = build_model(cfg, task, criterion, lambda model: InitialValues(model, model.init_seed), None)
    return Trainer(cfg, task, model, criterion, ds_config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--steps", type=int, default=10)
    on_gpu = parser.parse_known_args()[0].device == "cuda"
    for name, gpu, cpu in (("layers", 24, 8), ("dim", 2048, 512), ("heads", 32, 8), ("ffn", 8192, 2048)):
        parser.add_argument(f"--{name}", type=int, default=gpu if on_gpu else cpu)
    args = parser.parse_args()
    if args.dtype == "fp16" and args.device == "cpu":
        raise SystemExit("zero0_step: --dtype fp16 needs a GPU (DeepSpeed's CPU accelerator trains no fp16)")
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    trainer = build_trainer(args)
    wrapper, device = trainer.engine.optimizer, trainer.engine.device
    if not isinstance(wrapper, FP16_UnfusedOptimizer):
        raise SystemExit(f"zero0_step: DeepSpeed built a {type(wrapper).__name__}, not FP16_UnfusedOptimizer: nothing to compare")
    params = [param for group in wrapper.fp16_groups for param in group]
    generator = torch.Generator().manual_seed(0)
    for param in params:  # read, never written, by both steps
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(device, param.dtype)
    steps: Dict[str, Callable[[], object]] = {"DeepSpeed": FP16_UnfusedOptimizer.step.__get__(wrapper),
                                              "mseq train": wrapper.step}
    if steps["mseq train"] == steps["DeepSpeed"]:
        raise SystemExit("zero0_step: the trainer left DeepSpeed's step in place (see optim.zero_step): nothing to compare")
    counts = {}
    for name, step in steps.items():
        step()  # warm-up: optimizer state, allocator
        with CountedOps() as counted:
            step()
        counts[name] = counted.ops
    seconds = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            seconds[name].append(timed(step, device))
    median = {name: statistics.median(times) for name, times in seconds.items()}
    numel = sum(param.numel() for param in params)
    for name in steps:
        print(f"{name}: {median[name] * 1e3:.2f} ms a step, {counts[name]['aten._local_scalar_dense']} device reads, "
              f"{sum(counts[name].values())} aten operations; runs {', '.join(f'{s * 1e3:.1f}' for s in seconds[name])} ms")
    reads = {name: counts[name]["aten._local_scalar_dense"] for name in steps}
    print(f"summary: ZeRO-0 {args.dtype} optimizer step, {numel / 1e6:.1f} M parameters in {len(params)} tensors on "
          f"{device.type}: DeepSpeed {median['DeepSpeed'] * 1e3:.2f} ms ({reads['DeepSpeed']} device reads), "
          f"mseq train {median['mseq train'] * 1e3:.2f} ms ({reads['mseq train']}): "
          f"{median['DeepSpeed'] / median['mseq train']:.2f}x as fast", flush=True)


if __name__ == "__main__":
    main()
