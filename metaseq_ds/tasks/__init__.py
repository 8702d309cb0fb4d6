"""Tasks: the registry behind `--task`, the task bases, and the built-in streaming LM task."""

from typing import Any

from metaseq_ds.registry import Registry
from metaseq_ds.tasks.base_task import BaseTask, LegacyTask

TASK_REGISTRY: Registry[BaseTask] = Registry("task", "--task", base=BaseTask)
register_task = TASK_REGISTRY.register


def setup_task(task_cfg: Any, **kwargs) -> BaseTask:
    """Build the task that `task_cfg` (a registered task's config) belongs to."""
    return TASK_REGISTRY.get(task_cfg._name).cls.setup_task(task_cfg, **kwargs)


# Built-in tasks register on import (after the registry exists).
from metaseq_ds.tasks import streaming_language_modeling  # noqa: E402

__all__ = ["BaseTask", "LegacyTask", "TASK_REGISTRY", "register_task", "setup_task", "streaming_language_modeling"]
