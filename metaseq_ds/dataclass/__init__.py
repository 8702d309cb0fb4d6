"""Configs: `MetaseqDataclass` (base of every section and plugin config) and `MetaseqConfig`."""

from metaseq_ds.dataclass.base import ChoiceEnum, MetaseqDataclass, make_read_only, validate_config, validate_value
from metaseq_ds.dataclass.configs import (
    COMPONENT_SECTIONS,
    FIXED_SECTIONS,
    CheckpointConfig,
    CommonConfig,
    DatasetConfig,
    DistributedTrainingConfig,
    MetaseqConfig,
    OptimizationConfig,
)

__all__ = [
    "ChoiceEnum",
    "CheckpointConfig",
    "CommonConfig",
    "COMPONENT_SECTIONS",
    "DatasetConfig",
    "DistributedTrainingConfig",
    "FIXED_SECTIONS",
    "MetaseqConfig",
    "MetaseqDataclass",
    "make_read_only",
    "OptimizationConfig",
    "validate_config",
    "validate_value",
]
