"""`mseq train`: train an OPT-style LM; the same module runs alone or under a launcher.

    mseq train                                   # demo: tiny model on the Python stdlib's sources
    mseq train DATA --arch opt_125m --lr 6e-4 ...  # metaseq's flags
    deepspeed --num_gpus 2 --module metaseq_ds.cli.train DATA ...
    torchrun --nproc_per_node 2 -m metaseq_ds.cli.train DATA ...

This module is the wiring and the loop: config (`options`) -> process groups -> what to resume
from (`CheckpointManager.plan`) -> task -> the model, built on the meta device, sharded and
materialised rank by rank (`distributed.materialize`) -> `Trainer` (the DeepSpeed engine) ->
restore -> train, validate, save.
"""

import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from metaseq_ds.errors import UsageError

logger = logging.getLogger("metaseq_ds.cli.train")


def cli_main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        from metaseq_ds.options import TrainArgumentParser

        argv = [a for a in argv if a not in ("-h", "--help")]
        try:
            print(TrainArgumentParser(argv).format_help())
        except UsageError as error:
            _fail(error)
        return
    try:
        from metaseq_ds.options import parse_train_config

        cfg = parse_train_config(argv)
        main(cfg)
    except UsageError as error:
        _fail(error)


def _fail(error: UsageError) -> None:
    print(f"mseq train: error: {error}", file=sys.stderr)
    raise SystemExit(error.exit_code)


def main(cfg) -> None:
    if cfg.common.dry_run:
        dry_run(cfg)
        return
    import torch

    from metaseq_ds import tasks
    from metaseq_ds.checkpoint.layout import Layout
    from metaseq_ds.checkpoint.manager import CheckpointManager
    from metaseq_ds.convert.hf_import import read_hf_model
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.deepspeed_config import accelerator_traits, build_deepspeed_config
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.distributed.parallelize import check_compile_layers
    from metaseq_ds.distributed.tensor_parallel import check_world, tensor_parallel_size
    from metaseq_ds.logging.progress_bar import StatsSink, setup_logging
    from metaseq_ds.optim import check_optimizer_kernels
    from metaseq_ds.trainer import Trainer

    tp_size = tensor_parallel_size(cfg)
    dist_utils.prepare_environment(cfg.distributed_training.distributed_port)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup_logging(cfg.common.log_file if rank == 0 else None, quiet=rank != 0)
    _check_world_size(cfg, world_size)
    check_world(tp_size, world_size)
    dist_utils.init_distributed(cfg.distributed_training.distributed_port, tp_size)
    check_optimizer_kernels(cfg.optimizer)  # a JIT kernel that cannot build stops us before anything is written
    dp_rank, dp_size = dist_utils.get_data_parallel_rank(), dist_utils.get_data_parallel_world_size()
    checkpoints = CheckpointManager(cfg, Layout.of_run(cfg, world_size), foreign_formats={"hf": read_hf_model})
    plan = checkpoints.plan()
    cfg = checkpoints.resolve_config(plan)
    if cfg.dataset.demo:
        _build_demo_corpus(Path(cfg.task.data), rank)

    torch.manual_seed(cfg.common.seed)  # the same initial weights whatever the layout
    task = tasks.setup_task(cfg.task)
    criterion = task.build_criterion(cfg.criterion)
    ds_config = build_deepspeed_config(cfg, world_size, **accelerator_traits())
    check_compile_layers(cfg.distributed_training.compile_layers, ds_config["zero_optimization"]["stage"])
    zero3_config = ds_config if ds_config["zero_optimization"]["stage"] == 3 else None
    model = build_model(cfg, task, criterion, lambda model: checkpoints.parameter_values(plan, model), zero3_config)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: before partitioning
    logger.info(f"model {cfg.arch}: {n_params:,} parameters (on this rank's tensor-parallel share); {world_size} "
                f"rank(s)" + (f" = {dp_size} data-parallel x {tp_size} tensor-parallel" if tp_size > 1 else ""))
    trainer = Trainer(cfg, task, model, criterion, ds_config)
    logger.info(f"DeepSpeed: ZeRO stage {trainer.zero_stage}, micro-batch {cfg.dataset.batch_size}, "
                f"update-freq {cfg.optimization.update_freq}, bf16 {trainer.ds_config['bf16']['enabled']}")

    epoch_itr = task.get_batch_iterator(
        split="train", batch_size=cfg.dataset.batch_size, seed=cfg.common.seed,
        num_shards=dp_size, shard_id=dp_rank, epoch=1,
        num_workers=cfg.dataset.num_workers, data_buffer_size=cfg.dataset.data_buffer_size,
    )
    checkpoints.restore(plan, trainer, epoch_itr)

    sink = StatsSink(cfg.common.log_format, cfg.common.tensorboard_logdir, cfg.common.progress_bar,
                     cfg.optimization.max_update, enabled=rank == 0)
    try:
        last_valid = train_loop(cfg, task, trainer, epoch_itr, checkpoints, sink)
    finally:
        sink.close()
    if rank == 0:
        _print_next_steps(cfg, last_valid)


def dry_run(cfg) -> None:
    """`--dry-run`: the per-rank memory plan of these flags (`distributed.memory_plan`)."""
    from metaseq_ds.distributed.memory_plan import describe, plan_memory
    from metaseq_ds.distributed.tensor_parallel import check_world, tensor_parallel_size

    world_size = cfg.distributed_training.distributed_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    check_world(tensor_parallel_size(cfg), world_size)
    print("\n".join(describe(plan_memory(cfg, world_size), cfg.arch)), flush=True)


def train_loop(cfg, task, trainer, epoch_itr, checkpoints, sink):
    """Updates until --max-update/--max-epoch/--stop-min-lr, validating and saving on schedule.

    The log lines are metaseq's, from its `metrics` aggregators: each update runs inside
    "train_inner" (a line every --log-interval updates, then reset) and "train" (a line at the
    end of each epoch's training, keys prefixed "train_"), so each shows exactly what the task,
    criterion and trainer logged.

    The device is read once per log line, not once per update (a host sync that idles a GPU):
    the updates since the last read are read together and checked for divergence then, and
    before anything is validated or saved, so a diverged update is never logged or saved."""
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.divergence import check_update
    from metaseq_ds.logging import metrics
    from metaseq_ds.logging.reduction import read_values

    opt, ds_cfg, ckpt = cfg.optimization, cfg.dataset, cfg.checkpoint
    start_wall = time.perf_counter()
    last_valid = None
    unlogged_updates = 0
    unread = []  # (update number, `Trainer.train_step`'s stats) since the last read

    def finished() -> bool:
        return bool(opt.max_update and trainer.num_updates >= opt.max_update) or 0 <= trainer.get_lr() < opt.stop_min_lr

    def read_updates() -> None:
        """Read the unread updates in one transfer; `TrainingDiverged` names the first that diverged."""
        for (update, _), stats in zip(unread, read_values([stats for _, stats in unread])):
            check_update(stats, update, cfg, checkpoints.saved_update)
        unread.clear()

    def log_line(tag: str, aggregator: str, prefix: str = "", **first) -> None:
        read_updates()
        values = {**metrics.get_smoothed_values(aggregator), "wall": time.perf_counter() - start_wall}
        sink.log(tag, {**first, **{prefix + key: value for key, value in values.items()}}, trainer.num_updates)
        sink.advance(trainer.num_updates, {key: value for key, value in values.items() if key in BAR_KEYS})
        metrics.reset_meters(aggregator)

    while not finished():
        if opt.max_epoch and epoch_itr.epoch > opt.max_epoch:
            break
        itr = epoch_itr.next_epoch_itr()
        task.begin_epoch(epoch_itr.epoch, trainer.engine.module)
        stop = False
        with metrics.aggregate("train"):
            for samples in _groups(itr, opt.update_freq):
                with metrics.aggregate("train_inner"):
                    unread.append((trainer.num_updates + 1, trainer.train_step(samples)))
                unlogged_updates += 1
                n = trainer.num_updates
                sink.advance(n)
                if n % cfg.common.log_interval == 0:
                    log_line("train_inner", "train_inner", epoch=epoch_itr.epoch, update=n)
                    unlogged_updates = 0
                stop = finished()
                if ds_cfg.validate_interval_updates and n % ds_cfg.validate_interval_updates == 0 and not stop:
                    read_updates()
                    last_valid = _validate(cfg, task, trainer, epoch_itr.epoch, sink)
                if ckpt.save_interval_updates and n % ckpt.save_interval_updates == 0 and not stop:
                    read_updates()
                    checkpoints.save(trainer, epoch_itr)
                if stop:
                    break
        if unlogged_updates:
            log_line("train_inner", "train_inner", epoch=epoch_itr.epoch, update=trainer.num_updates)
            unlogged_updates = 0
        if metrics.get_meters("train"):
            log_line("train", "train", prefix="train_", epoch=epoch_itr.epoch)
        if stop:
            break
        epoch_done = epoch_itr.epoch
        if not ds_cfg.disable_validation and epoch_done % ds_cfg.validate_interval == 0:
            last_valid = _validate(cfg, task, trainer, epoch_done, sink)
        if not ckpt.no_epoch_checkpoints and epoch_done % ckpt.save_interval == 0:
            checkpoints.save(trainer, epoch_itr)
    if not ds_cfg.disable_validation:
        last_valid = _validate(cfg, task, trainer, epoch_itr.epoch, sink)
    checkpoints.save_at_end(trainer, epoch_itr)
    dist_utils.barrier()
    return last_valid


# What the progress bar shows of each log line.
BAR_KEYS = ("loss", "ppl", "gnorm")


def _groups(itr, size):
    """Micro-batches in groups of `update_freq`; a partial group at the epoch's end is dropped."""
    group = []
    for sample in itr:
        group.append(sample)
        if len(group) == size:
            yield group
            group = []


def _validate(cfg, task, trainer, epoch, sink):
    """Each --valid-subset through `validation.validate`: a line of the criterion's keys, prefixed
    "valid_" as metaseq's; {subset: values} for the closing summary."""
    results = {}
    task.begin_valid_epoch(epoch, trainer.engine.module)
    for subset in [s.strip() for s in cfg.dataset.valid_subset.split(",") if s.strip()]:
        itr = task.get_batch_iterator(
            split=subset, batch_size=cfg.dataset.batch_size_valid or cfg.dataset.batch_size, seed=cfg.common.seed,
            num_shards=trainer.data_parallel_size, shard_id=trainer.data_parallel_rank, epoch=1,
            num_workers=cfg.dataset.num_workers, data_buffer_size=cfg.dataset.data_buffer_size,
        ).next_epoch_itr()
        values = trainer.validate(itr, cfg.dataset.max_valid_steps)
        results[subset] = values
        sink.log("valid" if subset == "valid" else f"valid_{subset}",
                 {"epoch": epoch, **{f"valid_{key}": value for key, value in values.items()},
                  "valid_num_updates": trainer.num_updates}, trainer.num_updates)
    return results


def _build_demo_corpus(data_dir: Path, rank: int) -> None:
    from metaseq_ds.data.demo_corpus import build_demo_corpus
    from metaseq_ds.distributed import utils as dist_utils

    if rank == 0:
        build_demo_corpus(data_dir)
    dist_utils.barrier()
    logger.info(f"no data given: training on the demo corpus in {data_dir} (Python standard library sources)")


def _check_world_size(cfg, world_size: int) -> None:
    expected = cfg.distributed_training.distributed_world_size
    if expected is not None and expected != world_size:
        raise UsageError(f"--distributed-world-size {expected} but the launcher started {world_size} rank(s)")


def _print_next_steps(cfg, last_valid) -> None:
    save_dir = cfg.checkpoint.save_dir
    lines = [f"{subset}: {_summary(values)}" for subset, values in (last_valid or {}).items() if values]
    if cfg.dataset.demo:
        from metaseq_ds.data.demo_corpus import unigram_entropy

        lines.append(f"byte-unigram entropy of the demo corpus: {unigram_entropy(Path(cfg.task.data), 'valid'):.3f} bits/token")
    lines.append(f"validate:  mseq validate --path {save_dir}")
    lines.append(f"continue:  rerun the same command with a larger --max-update (resumes from {save_dir}/checkpoint_last)")
    print("\n".join(lines), flush=True)


def _summary(values) -> str:
    """`loss 3.751 bits/token, ppl 13.46` (the README's line, which CI reads), then the criterion's other keys."""
    from metaseq_ds.logging.progress_bar import format_values

    rest = {key: value for key, value in values.items() if key not in ("loss", "ppl", "wpb", "bsz")}
    if "loss" not in values or "ppl" not in values:
        return format_values(values)
    return f"loss {values['loss']:.3f} bits/token, ppl {values['ppl']:.2f}" + (f" | {format_values(rest)}" if rest else "")


if __name__ == "__main__":
    cli_main()
