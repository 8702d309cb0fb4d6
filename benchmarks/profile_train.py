"""Where a metaseq_ds (or Hugging Face) training step spends its time: torch.profiler's top ops.

    python -m benchmarks.profile_train [--dtype bf16] [--side ours] [--steps 2] [--top 25]

One process, the configuration of `benchmarks/train.py` (same flags, same DeepSpeed config),
after one warm-up step; prints the ops by self CPU time, summed over `--steps` steps.
"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.train_worker import add_run_arguments, batches, hf_step_fn, our_step_fn, train_flags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=["ours", "hf"], default="ours")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    add_run_arguments(parser)
    args = parser.parse_args()

    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.options import parse_train_config

    dist_utils.init_distributed()
    args.world_size = 1
    cfg = parse_train_config(train_flags(args))
    torch.manual_seed(cfg.common.seed)
    step, _ = (our_step_fn if args.side == "ours" else hf_step_fn)(cfg, args)
    data = batches(args, 1 + args.steps)
    step(next(data))  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for tokens in data:
            step(tokens)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
