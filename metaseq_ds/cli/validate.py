"""`mseq validate --path CKPT`: the criterion's metrics of a checkpoint (loss in bits, ppl, and
whatever a plugin criterion logs), per valid subset.

Runs in one process on the consolidated weights (ZeRO shards are gathered), so a checkpoint
saved by any number of ranks validates anywhere; the pass is training's own
(`metaseq_ds.validation.validate`), so the figures are those of `mseq train`'s valid line.
"""

from typing import Optional


def main(path: str, valid_subset: Optional[str], data: Optional[str], batch_size: Optional[int],
         max_valid_steps: Optional[int], user_dir: Optional[str] = None) -> None:
    from metaseq_ds.dataclass import DatasetConfig, validate_value

    # The run's own fields, so the run's ranges; checked before torch is imported or anything loads.
    for name, value in (("batch_size", batch_size), ("max_valid_steps", max_valid_steps)):
        if value is not None:
            validate_value(DatasetConfig, name, value, "--" + name.replace("_", "-"))

    from metaseq_ds.checkpoint.inference import load_model_for_inference
    from metaseq_ds.logging.progress_bar import format_values, setup_logging
    from metaseq_ds.validation import validate

    setup_logging()
    cfg, task, model, ref = load_model_for_inference(path, data, user_dir=user_dir)
    meta = ref.meta()
    criterion = task.build_criterion(cfg.criterion)
    for subset in (valid_subset or cfg.dataset.valid_subset).split(","):
        subset = subset.strip()
        batches = task.get_batch_iterator(
            split=subset, batch_size=batch_size or cfg.dataset.batch_size_valid or cfg.dataset.batch_size,
            seed=cfg.common.seed, num_shards=1, shard_id=0, epoch=1,
        ).next_epoch_itr()
        values = validate(task, model, criterion, batches, max_valid_steps)
        print(f"{subset}: {format_values(values) or 'no batches'} | checkpoint {ref.path} (update {meta['num_updates']})",
              flush=True)
