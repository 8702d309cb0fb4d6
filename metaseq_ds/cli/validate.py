"""`mseq validate --path CKPT`: loss (base 2) and perplexity of a checkpoint, per valid subset.

Runs in one process on the consolidated weights (ZeRO shards are gathered), so a checkpoint
saved by any number of ranks validates anywhere.
"""

import logging
import math
from typing import Optional

logger = logging.getLogger("metaseq_ds.cli.validate")


def main(path: str, valid_subset: Optional[str], data: Optional[str], batch_size: Optional[int],
         max_valid_steps: Optional[int]) -> None:
    import torch

    from metaseq_ds import checkpoint_utils
    from metaseq_ds.logging.progress_bar import setup_logging

    setup_logging()
    cfg, task, model, ref = checkpoint_utils.load_model_for_inference(path, data)
    meta = ref.meta()
    criterion = task.build_criterion(cfg.criterion)
    for subset in (valid_subset or cfg.dataset.valid_subset).split(","):
        subset = subset.strip()
        itr = task.get_batch_iterator(
            split=subset, batch_size=batch_size or cfg.dataset.batch_size_valid or cfg.dataset.batch_size,
            seed=cfg.common.seed, num_shards=1, shard_id=0, epoch=1,
        ).next_epoch_itr()
        loss_sum = tokens = 0.0
        with torch.no_grad():
            for step, sample in enumerate(itr):
                if max_valid_steps is not None and step >= max_valid_steps:
                    break
                _, _, logging_output = task.valid_step(sample, model, criterion)
                loss_sum += float(logging_output["loss"])
                tokens += float(logging_output["ntokens"])
        loss = loss_sum / max(tokens, 1.0) / math.log(2)
        print(f"{subset}: loss {loss:.4f} | ppl {2 ** loss:.3f} | tokens {int(tokens)} | "
              f"checkpoint {ref.path} (update {meta['num_updates']})", flush=True)
