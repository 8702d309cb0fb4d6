"""`mseq train`: train an OPT-style LM; the same module runs alone or under a launcher.

    mseq train                                   # demo: tiny model on the Python stdlib's sources
    mseq train DATA --arch opt_125m --lr 6e-4 ...  # metaseq's flags
    deepspeed --num_gpus 2 --module metaseq_ds.cli.train DATA ...
    torchrun --nproc_per_node 2 -m metaseq_ds.cli.train DATA ...
"""

import logging
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from metaseq_ds.errors import UsageError

logger = logging.getLogger("metaseq_ds.cli.train")

DEMO_DATA_DIR = Path("data") / "demo_corpus"


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
    import torch

    from metaseq_ds import tasks
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.parallelize import parallelize
    from metaseq_ds.distributed.tensor_parallel import check_world, tensor_parallel_size
    from metaseq_ds.logging.progress_bar import StatsSink, setup_logging
    from metaseq_ds.trainer import Trainer

    tp_size = tensor_parallel_size(cfg)
    dist_utils.prepare_environment(cfg.distributed_training.distributed_port)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    setup_logging(cfg.common.log_file if rank == 0 else None, quiet=rank != 0)
    _check_world_size(cfg, world_size)
    check_world(tp_size, world_size)
    dist_utils.init_distributed(cfg.distributed_training.distributed_port, tp_size)
    dp_rank, dp_size = dist_utils.get_data_parallel_rank(), dist_utils.get_data_parallel_world_size()
    demo = cfg.task.data is None
    if demo:
        cfg.task.data = str(_demo_corpus(rank))
    restore = _find_restore(cfg)
    _keep_saved_vocabulary(cfg, restore)

    torch.manual_seed(cfg.common.seed)  # identical initial weights on every rank
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    start_from = _weights_restore(restore, cfg, world_size)
    if start_from is not None:  # weights go into the plain model, before TP/ZeRO touch it
        start_from.load_into(model)
    criterion = task.build_criterion(cfg.criterion)
    model = parallelize(model, cfg, criterion)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"model {cfg.arch}: {n_params:,} parameters (on this rank); {world_size} rank(s)"
                + (f" = {dp_size} data-parallel x {tp_size} tensor-parallel" if tp_size > 1 else ""))
    trainer = Trainer(cfg, task, model, criterion)
    logger.info(f"DeepSpeed: ZeRO stage {trainer.zero_stage}, micro-batch {cfg.dataset.batch_size}, "
                f"update-freq {cfg.optimization.update_freq}, bf16 {trainer.ds_config['bf16']['enabled']}")

    epoch_itr = task.get_batch_iterator(
        split="train", batch_size=cfg.dataset.batch_size, seed=cfg.common.seed,
        num_shards=dp_size, shard_id=dp_rank, epoch=1,
    )
    if start_from is not None:
        start_from.after_trainer(cfg, trainer, epoch_itr, dp_size)
    elif restore is not None:
        _restore(cfg, trainer, epoch_itr, restore)

    sink = StatsSink(cfg.common.log_format, cfg.common.tensorboard_logdir, cfg.common.progress_bar,
                     cfg.optimization.max_update, enabled=rank == 0)
    try:
        last_valid = _train_loop(cfg, task, trainer, epoch_itr, sink)
    finally:
        sink.close()
    if rank == 0:
        _print_next_steps(cfg, demo, last_valid)


def _train_loop(cfg, task, trainer, epoch_itr, sink):
    from metaseq_ds.distributed import utils as dist_utils

    opt, ds_cfg = cfg.optimization, cfg.dataset
    start_wall = time.perf_counter()
    last_valid = None
    window = _Window()
    saved_at = trainer.num_updates
    def finished() -> bool:
        return bool(opt.max_update and trainer.num_updates >= opt.max_update) or 0 <= trainer.get_lr() < opt.stop_min_lr

    while not finished():
        if opt.max_epoch and epoch_itr.epoch > opt.max_epoch:
            break
        itr = epoch_itr.next_epoch_itr()
        stop = False
        for samples in _groups(itr, opt.update_freq):
            stats = trainer.train_step(samples)
            window.add(stats)
            n = trainer.num_updates
            sink.advance(n, stats["loss"])
            if n % cfg.common.log_interval == 0:
                sink.log("train_inner", window.flush(epoch_itr.epoch, n, trainer.get_lr(), time.perf_counter() - start_wall), n)
            stop = finished()
            if ds_cfg.validate_interval_updates and n % ds_cfg.validate_interval_updates == 0 and not stop:
                last_valid = _validate(cfg, task, trainer, epoch_itr.epoch, sink)
            if cfg.checkpoint.save_interval_updates and n % cfg.checkpoint.save_interval_updates == 0 and not stop:
                _save(cfg, trainer, epoch_itr)
                saved_at = n
            if stop:
                break
        if stop:
            break
        epoch_done = epoch_itr.epoch
        if not ds_cfg.disable_validation and epoch_done % ds_cfg.validate_interval == 0:
            last_valid = _validate(cfg, task, trainer, epoch_done, sink)
        if not cfg.checkpoint.no_epoch_checkpoints and epoch_done % cfg.checkpoint.save_interval == 0:
            _save(cfg, trainer, epoch_itr)
            saved_at = trainer.num_updates
    if window.count:
        sink.log("train_inner", window.flush(epoch_itr.epoch, trainer.num_updates, trainer.get_lr(), time.perf_counter() - start_wall), trainer.num_updates)
    if not ds_cfg.disable_validation:
        last_valid = _validate(cfg, task, trainer, epoch_itr.epoch, sink)
    if saved_at != trainer.num_updates or not _has_checkpoint(cfg):
        _save(cfg, trainer, epoch_itr)
    dist_utils.barrier()
    return last_valid


def _groups(itr, size):
    """Micro-batches in groups of `update_freq`; a partial group at the epoch's end is dropped."""
    group = []
    for sample in itr:
        group.append(sample)
        if len(group) == size:
            yield group
            group = []


class _Window:
    """Accumulates per-update stats between two `train_inner` lines."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.count = 0
        self.loss = self.tokens = self.sentences = self.gnorm = self.clip = self.train_wall = 0.0
        self.started = time.perf_counter()

    def add(self, stats):
        self.count += 1
        self.loss += stats["loss"] * stats["ntokens"]
        self.tokens += stats["ntokens"]
        self.sentences += stats["nsentences"]
        self.gnorm += stats["gnorm"]
        self.clip += stats["clip"]
        self.train_wall += stats["train_wall"]

    def flush(self, epoch, num_updates, lr, wall):
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        loss = self.loss / max(self.tokens, 1.0)
        out = {
            "epoch": epoch, "update": num_updates, "loss": loss, "ppl": 2**loss,
            "wps": self.tokens / elapsed, "ups": self.count / elapsed, "wpb": self.tokens / self.count,
            "bsz": self.sentences / self.count, "num_updates": num_updates, "lr": lr,
            "gnorm": self.gnorm / self.count, "clip": self.clip / self.count,
            "train_wall": self.train_wall, "wall": wall,
        }
        self.reset()
        return out


def _validate(cfg, task, trainer, epoch, sink):
    results = {}
    for subset in [s.strip() for s in cfg.dataset.valid_subset.split(",") if s.strip()]:
        itr = task.get_batch_iterator(
            split=subset, batch_size=cfg.dataset.batch_size_valid or cfg.dataset.batch_size, seed=cfg.common.seed,
            num_shards=trainer.data_parallel_size, shard_id=trainer.data_parallel_rank, epoch=1,
        ).next_epoch_itr()
        stats = trainer.valid_loss(itr, cfg.dataset.max_valid_steps)
        results[subset] = stats
        sink.log("valid" if subset == "valid" else f"valid_{subset}",
                 {"epoch": epoch, "valid_loss": stats["loss"], "valid_ppl": stats["ppl"],
                  "valid_wpb": stats["ntokens"], "num_updates": trainer.num_updates}, trainer.num_updates)
    return results


def _save(cfg, trainer, epoch_itr) -> None:
    from metaseq_ds import checkpoint_utils
    from metaseq_ds.distributed import utils as dist_utils

    if cfg.checkpoint.no_save:
        return
    save_dir = Path(cfg.checkpoint.save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    ref = checkpoint_utils.CheckpointRef(save_dir, checkpoint_utils.tag_for(epoch_itr.epoch, trainer.num_updates))
    client_state = trainer.client_state()
    client_state["iterator"] = epoch_itr.state_dict()
    trainer.engine.save_checkpoint(str(save_dir), tag=ref.tag, client_state=client_state, save_latest=False)
    dist_utils.barrier()  # every rank's shards are on disk before the save counts
    if dist_utils.is_master():
        checkpoint_utils.write_meta(ref, {
            "config": cfg.to_dict(), "num_updates": trainer.num_updates, "epoch": epoch_itr.epoch,
            "world_size": trainer.world_size, "zero_stage": trainer.zero_stage,
            **checkpoint_utils.tensor_parallel_meta(trainer.engine.module, trainer.world_size // trainer.data_parallel_size),
        })
        checkpoint_utils.mark_last(ref)
        checkpoint_utils.remove_old_checkpoints(save_dir, cfg.checkpoint.keep_last_updates, ref.tag)
        logger.info(f"saved checkpoint {ref.path} (update {trainer.num_updates})")
    dist_utils.barrier()


def _has_checkpoint(cfg) -> bool:
    return (Path(cfg.checkpoint.save_dir) / "checkpoint_last").is_file() or cfg.checkpoint.no_save


def _find_restore(cfg):
    """The checkpoint to resume from, checked against this run before any model is built."""
    from metaseq_ds import checkpoint_utils
    from metaseq_ds.convert.restore import HF_PREFIX, hf_restore

    if cfg.checkpoint.restore_file.startswith(HF_PREFIX):
        return hf_restore(cfg)
    ref = checkpoint_utils.find_checkpoint(cfg.checkpoint.restore_file, cfg.checkpoint.save_dir)
    if ref is None:
        if cfg.checkpoint.restore_file != "checkpoint_last":
            raise UsageError(f"--restore-file: no checkpoint at {cfg.checkpoint.restore_file}")
        return None
    meta = ref.meta()
    # An imported checkpoint names no --arch of ours (its sizes are explicit): compare the model only.
    arch = meta["config"].get("arch") if meta.get("weights_only") else cfg.arch
    checkpoint_utils.check_compatible(meta, arch, cfg.to_dict()["model"], ref.save_dir)
    return ref, meta


def _keep_saved_vocabulary(cfg, restore) -> None:
    """Resuming at another tensor-parallel degree keeps the checkpoint's padded vocabulary (its
    padding rows are already trained), so the run continues exactly where the saved one was."""
    from metaseq_ds.convert.restore import WeightsRestore

    if restore is None or isinstance(restore, WeightsRestore) or "padding_factor" not in cfg.task.__dataclass_fields__:
        return
    _, meta = restore
    saved_factor = meta["config"]["task"].get("padding_factor", 8)
    if cfg.task.final_vocab_size is None and saved_factor % cfg.task.padding_factor == 0:
        cfg.task.padding_factor = saved_factor


def _weights_restore(restore, cfg, world_size):
    """None for an exact resume; else weights to load first (import, hf:DIR, other ranks/ZeRO stage)."""
    if restore is None:
        return None
    from metaseq_ds.convert.restore import weights_restore

    return weights_restore(restore, cfg, world_size)


def _restore(cfg, trainer, epoch_itr, restore) -> None:
    from metaseq_ds.distributed import utils as dist_utils

    ref, meta = restore  # same ranks and ZeRO stage (else `_weights_restore` reshards)
    load_optimizer = not cfg.checkpoint.reset_optimizer
    _, client_state = trainer.engine.load_checkpoint(
        str(ref.save_dir), tag=ref.tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=False,
        load_module_only=not load_optimizer,
    )
    trainer.load_client_state(client_state)
    if not cfg.checkpoint.reset_dataloader:
        epoch_itr.load_state_dict(client_state["iterator"])
    dist_utils.barrier()
    logger.info(f"resumed from {ref.path} at update {trainer.num_updates}")


def _demo_corpus(rank: int) -> Path:
    from metaseq_ds.data.demo_corpus import build_demo_corpus
    from metaseq_ds.distributed import utils as dist_utils

    if rank == 0:
        build_demo_corpus(DEMO_DATA_DIR)
    dist_utils.barrier()
    logger.info(f"no data given: training on the demo corpus in {DEMO_DATA_DIR} (Python standard library sources)")
    return DEMO_DATA_DIR


def _check_world_size(cfg, world_size: int) -> None:
    expected = cfg.distributed_training.distributed_world_size
    if expected is not None and expected != world_size:
        raise UsageError(f"--distributed-world-size {expected} but the launcher started {world_size} rank(s)")


def _print_next_steps(cfg, demo: bool, last_valid) -> None:
    save_dir = cfg.checkpoint.save_dir
    lines = []
    if last_valid:
        for subset, stats in last_valid.items():
            lines.append(f"{subset}: loss {stats['loss']:.3f} bits/token, ppl {stats['ppl']:.2f}")
    if demo:
        from metaseq_ds.data.demo_corpus import unigram_entropy

        lines.append(f"byte-unigram entropy of the demo corpus: {unigram_entropy(Path(cfg.task.data), 'valid'):.3f} bits/token")
    lines.append(f"validate:  mseq validate --path {save_dir}")
    lines.append(f"continue:  rerun the same command with a larger --max-update (resumes from {save_dir}/checkpoint_last)")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    cli_main()
