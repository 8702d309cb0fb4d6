"""DeepSpeed's checkpoint files (deepspeed 0.19): ZeRO shards consolidated per tensor-parallel
rank, the optimizer state inside them, the classes pickled in them, and the engine's loader."""

from typing import Any, Callable, Dict, List

from metaseq_ds.private_apis.verified import relies_on


@relies_on("deepspeed", "zero_to_fp32._get_fp32_state_dict_from_zero{2,3}_checkpoint",
           written_for="0.19", cuda=True,
           why="zero_to_fp32's public entry point refuses a save of several tensor-parallel ranks (world_size != "
               "total_files); its per-stage workers, given one rank's files, consolidate it. Related: "
               "https://github.com/deepspeedai/DeepSpeed/pull/8168 (TP x DP in ds_to_universal)",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def consolidate_zero_shards(folder: str, tensor_parallel_rank: int) -> Dict[str, Any]:
    """The fp32 weights of one tensor-parallel rank of a ZeRO-1/2/3 checkpoint in `folder`,
    consolidated over its data-parallel shards (memory-mapped where DeepSpeed allows).

    zero_to_fp32's public entry point takes the whole folder and refuses a save of several
    tensor-parallel ranks; its per-stage workers, given one rank's files, do the job."""
    from deepspeed.utils import zero_to_fp32

    pattern = f"mp_rank_{tensor_parallel_rank:02d}"
    model_states = zero_to_fp32.parse_model_states(
        zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_model_states.pt"))
    stage, dp_size, flat_groups, paddings = zero_to_fp32.parse_optim_states(
        zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_optim_states.pt"), folder)
    if stage <= 2:
        return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(dp_size, flat_groups, model_states, False, paddings)
    return zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(dp_size, flat_groups, model_states, False)


@relies_on("deepspeed", "zero_to_fp32._get_fp32_state_dict_from_zero{2,3}_checkpoint and the optimizer state layout of ZeRO files",
           written_for="0.19", cuda=True,
           why="resharding reads Adam's moments per parameter; DeepSpeed's universal checkpoints read neither ZeRO-0 "
               "saves nor our tensor-parallel parts",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def zero_checkpoint_values(folder: str, tensor_parallel_rank: int, key: str, load: Callable[..., Any]) -> Dict[str, Any]:
    """One tensor-parallel rank's per-parameter `key` of a ZeRO-1/2/3 checkpoint in `folder`,
    consolidated over its data-parallel shards: "fp32" (the master weights) or an optimizer state
    ("exp_avg", "exp_avg_sq"). ZeRO-3 values are read lazily (`.contiguous()`) from memory-mapped
    files; ZeRO-1/2 ones are views of each parameter group joined over the ranks. `load` reads a
    file (`checkpoint.safe_loading.safe_load`).

    zero_to_fp32's per-stage workers consolidate the fp32 master partitions; the base optimizer's
    state tensors are flat partitions of the same layout (one flat parameter per group, DeepSpeed
    saves them without the alignment padding or with it at the end), so handing those workers the
    moments instead of the master weights consolidates the moments."""
    from deepspeed.utils import zero_to_fp32

    model_states, stage, optimizer_states = _zero_checkpoint_files(folder, tensor_parallel_rank, load)
    masters = [state["single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"] for state in optimizer_states]
    if key == "fp32":
        groups = masters
    else:
        groups = [[_base_optimizer_group_state(state, index)[key].narrow(0, 0, flat.numel()) for index, flat in enumerate(flats)]
                  for state, flats in zip(optimizer_states, masters)]
    dp_size = len(optimizer_states)
    if stage <= 2:
        return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
            dp_size, groups, model_states, False, optimizer_states[0].get("param_alignment_paddings"))
    return zero_to_fp32._get_fp32_state_dict_from_zero3_checkpoint(dp_size, groups, model_states, False)


@relies_on("deepspeed", "the base optimizer state in ZeRO checkpoints",
           written_for="0.19", cuda=True,
           why="the step count of a ZeRO save, for Adam's bias correction after resharding",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def zero_checkpoint_step(folder: str, tensor_parallel_rank: int, load: Callable[..., Any]) -> int:
    """The optimizer step count of a ZeRO-1/2/3 checkpoint (its base optimizer's, group 0)."""
    _, _, optimizer_states = _zero_checkpoint_files(folder, tensor_parallel_rank, load)
    return int(_base_optimizer_group_state(optimizer_states[0], 0)["step"])


def _zero_checkpoint_files(folder: str, tensor_parallel_rank: int, load: Callable[..., Any]):
    """(model states as zero_to_fp32 parses them, ZeRO stage, each data-parallel rank's optimizer
    state dict, memory-mapped by `load`, a `torch.load`)."""
    from deepspeed.utils import zero_to_fp32

    pattern = f"mp_rank_{tensor_parallel_rank:02d}"
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_model_states.pt"))
    optimizer_states = [load(path, map_location="cpu", mmap=True)["optimizer_state_dict"]
                        for path in zero_to_fp32.get_checkpoint_files(folder, f"*{pattern}_optim_states.pt")]
    return model_states, int(optimizer_states[0]["zero_stage"]), optimizer_states


def _base_optimizer_group_state(optimizer_state: Dict[str, Any], group: int) -> Dict[str, Any]:
    """The base (torch) optimizer's state of flat group `group`: ZeRO-3 saves the torch state dict
    ("optimizer_state_dict"), ZeRO-1/2 either that or, elastic, a list of per-group states."""
    if "fp32_flat_groups" in optimizer_state:
        return optimizer_state["optimizer_state_dict"]["state"][group]
    base = optimizer_state["base_optimizer_state"]
    return base[group] if isinstance(base, list) else base["state"][group]


@relies_on("deepspeed", "the classes pickled in its checkpoint files",
           written_for="0.19", cuda=True,
           why="DeepSpeed loads its files with weights_only=False, running whatever a file pickles "
               "(https://github.com/deepspeedai/DeepSpeed/pull/6751 made that explicit; #6094, closed, tried "
               "weights_only=True); we load them weights-only, allowing these few classes",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def checkpoint_file_classes() -> List[type]:
    """The few DeepSpeed classes pickled into its checkpoint files besides tensors and containers
    (loss scalers, the ZeRO stage enum, fragment addresses): what a weights-only load must accept."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler, torch.Size]


@relies_on("deepspeed", "DeepSpeedEngine.checkpoint_engine",
           written_for="0.19", cuda=True,
           why="the engine reads files through its checkpoint_engine attribute, whose default unpickles arbitrary "
               "objects (https://github.com/deepspeedai/DeepSpeed/pull/6751); no public hook",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process",
           canaries=(("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "weights_only=False"),))
def replace_checkpoint_loader(engine, load: Callable[..., Any]) -> None:
    """Make `engine.load_checkpoint` read every file with `load(path, map_location=None)`.

    The engine reads files through its `checkpoint_engine` attribute (not a public hook), whose
    default unpickles arbitrary objects; the rest of that object (saving) is kept."""
    engine.checkpoint_engine = _LoadOverride(engine.checkpoint_engine, load)


class _LoadOverride:
    def __init__(self, inner, load: Callable[..., Any]):
        self._inner, self._load = inner, load

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return self._load(path, map_location=map_location)
