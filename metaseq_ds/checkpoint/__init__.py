"""Checkpoints: planning what a run resumes from, saving, restoring, consolidating, resharding.

The map, from the doors down (each module imports only those below it):

    manager          `mseq train`'s one owner: plan (fresh / exact / reshard / weights), restore, save
    reshard          `mseq reshard`: any layout's save -> one consolidated, layout-free checkpoint
    inference        a checkpoint loaded for `validate`, `generate`, `serve` (each rank its part)
    optimizer_state  fp32 master weights, Adam moments and step: read from any layout, set on any
    values           saved weights as parameter values for `distributed.materialize`
    read             what a save holds, read lazily: weights (ZeRO shards and TP parts joined), client state
    layout           how a run or a save is split over ranks (`Layout`)
    files            the save dir on disk: tag dirs, the meta file, `checkpoint_last`, weights-only saves
    safe_loading     DeepSpeed's files through `torch.load(weights_only=True)`
    safetensors_io   weight files tensor by tensor: lazy reads, streamed writes
    staged_output    all-or-nothing output folders

Formats of other projects (Hugging Face, metaseq/fairseq `.pt`) are `metaseq_ds.convert`'s; it
depends on this package, never the reverse (`--restore-file hf:DIR` reaches the manager as a
reader handed in by `mseq train`). DeepSpeed's private file layouts are read through
`metaseq_ds.private_apis.deepspeed_checkpoints`.
"""
