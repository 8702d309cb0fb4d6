"""Process groups, the DeepSpeed config derived from ours, and rank queries."""

from metaseq_ds.distributed.utils import get_data_parallel_rank, get_data_parallel_world_size, get_global_rank, get_world_size, is_master

__all__ = ["get_data_parallel_rank", "get_data_parallel_world_size", "get_global_rank", "get_world_size", "is_master"]
