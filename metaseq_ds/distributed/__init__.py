"""Process groups, the DeepSpeed config derived from ours, and rank queries (metaseq's names).

The queries live in `metaseq_ds.distributed.utils` and load on first use, so that importing a
light submodule of this package (the tensor-parallel checks of flag parsing) loads no torch.
"""

__all__ = [
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_global_rank",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_world_size",
    "is_master",
]


def __getattr__(name: str):
    if name in __all__:
        from metaseq_ds.distributed import utils

        return getattr(utils, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
