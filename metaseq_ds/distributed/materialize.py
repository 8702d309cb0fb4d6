"""Build a model so that no rank ever holds it whole: meta device, plan, then shard by shard.

    model = build_model(cfg, task, criterion, values_for, zero3)

1. The model is constructed on the meta device: shapes only, nothing allocated or drawn.
2. `parallelize` applies the tensor-parallel plan to that meta model: DeepSpeed's TP layers
   keep meta shards of this rank's shape.
3. `materialize` then walks the modules in order and gives each parameter real storage holding
   this rank's values: the whole parameter is produced (drawn by the model's own initialiser, or
   read from a checkpoint) one tensor at a time, sliced to this rank's tensor-parallel shard and,
   under ZeRO-3, partitioned over the data-parallel group at once (`deepspeed.zero.Init(module=)`
   for just those parameters, with the data-parallel group as Megatron-DeepSpeed passes it).

Peak memory per rank: its share of the model plus one whole parameter. Why this route rather
than building under `deepspeed.zero.Init`: DeepSpeed's TP layers cannot shard a model built
under zero.Init (DEEPSPEED_CPU.md), and meta construction keeps initial values independent of
the layout (each parameter has its own generator: `models.initialization`), so 1 rank, ZeRO-3
on N ranks and any TP degree start from the same weights.

Under ZeRO-3 only the first rank of each data-parallel group produces values: zero.Init
broadcasts them to the group before partitioning, so the others never draw or read.
Models without `reset_parameter` (plugins that predate it) are built whole, then sharded.
"""

from typing import Any, Callable, Dict, Optional, Protocol, Sequence

import torch
from torch import nn

from metaseq_ds.distributed import utils as dist_utils
from metaseq_ds.distributed.deepspeed_config import training_precision
from metaseq_ds.distributed.tensor_parallel import partition_dim

class ParameterValues(Protocol):
    """Where parameters get their values: `models.initialization.InitialValues` (the model's own
    initialiser) or `checkpoint.values.CheckpointValues` (saved weights, read tensor by tensor)."""

    def shard(self, name: str, full_shape: Sequence[int], dim: Optional[int], rank: int, size: int) -> torch.Tensor:
        """This rank's part of parameter `name` (whole shape `full_shape`, split on `dim` into
        `size` equal parts; `dim` None: replicated)."""

    def check_all_used(self, parameter_names: Sequence[str]) -> None:
        """After every parameter was made (`parameter_names`, tied ones under each name): a value
        that no parameter takes is an error."""


def build_model(cfg, task, criterion, values_for: Callable[[nn.Module], Optional[ParameterValues]],
                zero3_config: Optional[Dict[str, Any]]) -> nn.Module:
    """The training model of this rank: built on the meta device, sharded by the plan, then
    materialised from `values_for(model)` (None: keep what construction gave, for models built
    whole); `zero3_config` (the DeepSpeed config) when ZeRO-3 partitions parameters."""
    from metaseq_ds import models
    from metaseq_ds.distributed.parallelize import parallelize

    meta = models.MODEL_REGISTRY.get(cfg.model._name).cls.can_materialize()
    if meta:
        with torch.device("meta"):
            model = task.build_model(cfg.model)
    else:
        model = task.build_model(cfg.model)
    model = parallelize(model, cfg, criterion)
    values = values_for(model)
    if values is not None:
        materialize(model, values, zero3_config if meta else None)
    return model


@torch.no_grad()
def materialize(model: nn.Module, values: ParameterValues, zero3_config: Optional[Dict[str, Any]] = None,
                device: Optional[torch.device] = None) -> None:
    """Give every parameter of `model` (meta or real, whole or TP-sharded by the plan) this
    rank's values on `device` (default: the rank's accelerator), module by module (see the module
    docstring), and move its buffers there too. A tied parameter stays one."""
    tp_rank = dist_utils.get_tensor_model_parallel_rank()
    tp_size = dist_utils.get_tensor_model_parallel_world_size()
    if device is None:
        device = _training_device()
    produces = zero3_config is None or dist_utils.get_data_parallel_rank() == 0
    dtype = _zero3_training_dtype(zero3_config)
    made: Dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        fresh = []
        for leaf, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) in made:
                module._parameters[leaf] = made[id(param)]
                continue
            name = f"{module_name}.{leaf}" if module_name else leaf
            dim = partition_dim(name) if tp_size > 1 else None
            full_shape = list(param.shape)
            if dim is not None:
                full_shape[dim] *= tp_size
            if produces:
                value = values.shard(name, full_shape, dim, tp_rank, tp_size)
            else:
                value = torch.empty(param.shape)
            new = nn.Parameter(value.to(device=device, dtype=dtype or param.dtype), requires_grad=param.requires_grad)
            new.__dict__.update(param.__dict__)  # DeepSpeed's TP layers mark their parameters
            made[id(param)] = module._parameters[leaf] = new
            fresh.append(new)
        if fresh and zero3_config is not None:
            _partition(fresh, zero3_config)
        for leaf, buffer in module._buffers.items():  # computed at construction (sinusoids): on the CPU
            if buffer is not None and not buffer.is_meta:
                module._buffers[leaf] = buffer.to(device)
    if produces:
        values.check_all_used([name for name, _ in model.named_parameters(remove_duplicate=False)])


def _zero3_training_dtype(zero3_config: Optional[Dict[str, Any]]) -> Optional[torch.dtype]:
    """ZeRO-3 partitions hold the training dtype, and `zero.Init(module=...)` keeps the dtype it is
    given (only modules built under it are cast), so bf16/fp16 parameters are made so here. Other
    stages keep fp32 parameters: DeepSpeed's engine casts the module itself."""
    if zero3_config is None:
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[training_precision(zero3_config)]


def _partition(params, zero3_config: Dict[str, Any]) -> None:
    """ZeRO-3-partition `params` now, over the data-parallel group (the first rank's values)."""
    import deepspeed

    holder = nn.ParameterList(params)  # zero.Init(module=...) converts a module's parameters
    deepspeed.zero.Init(module=holder, config_dict_or_path=zero3_config,
                        data_parallel_group=dist_utils.get_data_parallel_group(),
                        mpu=deepspeed.utils.groups if dist_utils.get_tensor_model_parallel_world_size() > 1 else None)


def _training_device() -> torch.device:
    import deepspeed

    return torch.device(deepspeed.get_accelerator().current_device_name())
