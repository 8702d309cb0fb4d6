"""Tasks: the registry behind `--task`, the task bases, and the built-in streaming LM task."""

from metaseq_ds.tasks.base_task import BaseTask, LegacyTask
from metaseq_ds.tasks.stateful_container import StatefulContainer

from metaseq_ds.tasks.registry import TASK_REGISTRY, register_task, setup_task

# Built-in tasks register on import.
from metaseq_ds.tasks import streaming_language_modeling

__all__ = ["BaseTask", "LegacyTask", "StatefulContainer", "TASK_REGISTRY", "register_task", "setup_task",
           "streaming_language_modeling"]
