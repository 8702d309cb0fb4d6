"""The `--task` registry. Re-exported by `metaseq_ds.tasks`."""

from typing import Any

from metaseq_ds.registry import Registry
from metaseq_ds.tasks.base_task import BaseTask

TASK_REGISTRY: Registry[BaseTask] = Registry("task", "--task", base=BaseTask)
register_task = TASK_REGISTRY.register


def setup_task(task_cfg: Any, **kwargs) -> BaseTask:
    """Build the task that `task_cfg` (a registered task's config) belongs to."""
    return TASK_REGISTRY.get(task_cfg._name).cls.setup_task(task_cfg, **kwargs)
