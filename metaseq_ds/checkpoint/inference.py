"""A checkpoint loaded for inference (`mseq validate`, `generate`, `serve`, `export`'s checks):
its config, task and model, each rank holding only its part."""

from pathlib import Path
from typing import Optional

from metaseq_ds.checkpoint.files import find_checkpoint
from metaseq_ds.checkpoint.read import lazy_model_weights
from metaseq_ds.checkpoint.values import CheckpointValues
from metaseq_ds.errors import UsageError


def load_model_for_inference(path: str, data: Optional[str] = None, need_data: bool = True,
                             user_dir: Optional[str] = None):
    """(cfg, task, model in eval mode, ref) of the checkpoint at `path` (`--path` of validate and
    generate), in fp32 on the accelerator (the CPU here); `data` overrides the run's data directory.

    A run trained with `--user-dir` needs its plugin's task, model and criterion again: the
    saved `common.user_dir` is imported, or `user_dir` where the plugin has moved since.

    The model is built on the meta device and filled tensor by tensor from the checkpoint's
    memory-mapped files (`distributed.materialize`), so no second copy of the weights is ever
    held. Under a launcher whose ranks form a tensor-parallel group, each rank builds its shard
    by the plan and reads only its part of each weight.
    With `need_data=False` (generation) the run's data directory need not exist any more.
    """
    from metaseq_ds import tasks
    from metaseq_ds.distributed import utils as dist_utils
    from metaseq_ds.distributed.materialize import build_model
    from metaseq_ds.distributed.tensor_parallel import check_divisible
    from metaseq_ds.models.initialization import InitialValues
    from metaseq_ds.options import config_from_dict

    ref = find_checkpoint(path)
    if ref is None:
        raise UsageError(f"--path: {path} is not a checkpoint (expected a save dir with checkpoint_last, or a checkpoint_* dir)")
    saved = ref.meta()["config"]
    _import_plugin(user_dir, saved.get("common", {}).get("user_dir"))
    if data is None and need_data and not saved["task"].get("data", True):
        raise UsageError(f"--path {path}: the checkpoint records no data directory (imported weights?): give --data DATA")
    # Without data (generation) the task opens no data directory: a moved corpus is no obstacle.
    overrides = {"task": {"data": data}} if data is not None or not need_data else {}
    cfg = config_from_dict(saved, overrides)
    tp_size = dist_utils.get_tensor_model_parallel_world_size()
    check_divisible(cfg.model, tp_size, source="the number of ranks,")
    task = tasks.setup_task(cfg.task)

    def saved_values(model):
        initial = InitialValues(model, model.init_seed) if model.init_seed is not None else None
        return CheckpointValues(lazy_model_weights(ref), str(ref.path), initial)

    model = build_model(cfg, task, None, saved_values, zero3_config=None)
    model.eval()
    return cfg, task, model, ref


def _import_plugin(given: Optional[str], saved: Optional[str]) -> None:
    from metaseq_ds.user_code import import_user_module, install_compat_if_asked

    if given is None and saved is not None and not Path(saved).exists():
        raise UsageError(f"the checkpoint was trained with --user-dir {saved}, which is gone: give --user-dir "
                         f"with the plugin's new place")
    if given or saved:
        install_compat_if_asked()  # a plugin that imports fairseq, under METASEQ_DS_COMPAT=1
        import_user_module(given or saved)
