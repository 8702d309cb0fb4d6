"""Where training stats go: metaseq's log lines, a rich progress bar, TensorBoard.

metaseq's JSON line (tools parse it, keep the keys):
    2026-12-02 12:00:00 | INFO | train_inner | {"epoch": 1, "update": 0.01, "loss": 7.1, ...}
Values are numbers, not strings. Only rank 0 writes.
"""

import json
import logging
import sys
from typing import Any, Dict, Optional

from metaseq_ds.errors import UsageError

LOG_FORMAT = "%(asctime)s | %(levelname)s | %(name)s | %(message)s"


def setup_logging(log_file: Optional[str] = None, quiet: bool = False) -> None:
    handlers = [logging.StreamHandler(sys.stdout)]
    if log_file:
        handlers.append(logging.FileHandler(log_file))
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO, format=LOG_FORMAT, datefmt="%Y-%m-%d %H:%M:%S",
        handlers=handlers, force=True,
    )
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def format_values(values: Dict[str, Any]) -> str:
    """`loss 3.142 | ppl 8.83 | ...`: values for a person to read (the bar, summaries)."""
    return " | ".join(f"{key} {_readable(value)}" for key, value in values.items())


def _readable(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 1e6 else f"{value:.4g}"
    return str(value)


def _round(value):
    if isinstance(value, float):
        return round(value, 6)
    return value


class StatsSink:
    """Formats stats as metaseq did and fans them out to the log, a bar and TensorBoard."""

    def __init__(self, log_format: str, tensorboard_logdir: Optional[str], progress_bar: str, total: int, enabled: bool):
        self.log_format = log_format
        self.enabled = enabled
        self.writer = None
        self.bar = None
        if not enabled:
            return
        if tensorboard_logdir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UsageError("--tensorboard-logdir needs the tensorboard package: pip install tensorboard") from None
            self.writer = SummaryWriter(tensorboard_logdir)
        if progress_bar == "rich" or (progress_bar == "auto" and sys.stdout.isatty()):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
                TimeRemainingColumn(), transient=True,
            )
            self.bar.start()
            self.bar_task = self.bar.add_task("train", total=total or None, stats="")

    def log(self, tag: str, stats: Dict[str, float], step: int) -> None:
        if not self.enabled:
            return
        stats = {k: _round(v) for k, v in stats.items()}
        if self.log_format == "json":
            logging.getLogger(tag).info(json.dumps(stats))
        elif self.log_format == "simple":
            logging.getLogger(tag).info(" | ".join(f"{k} {v}" for k, v in stats.items()))
        if self.writer is not None:
            for key, value in stats.items():
                if isinstance(value, (int, float)) and key not in ("epoch", "update"):
                    self.writer.add_scalar(f"{tag}/{key}", value, step)
            self.writer.flush()

    def advance(self, step: int, values: Optional[Dict[str, Any]] = None) -> None:
        """The bar at update `step`, showing `values` (the last log line's) if given, else the
        values it showed before."""
        if self.bar is None:
            return
        if values is None:
            self.bar.update(self.bar_task, completed=step)
        else:
            self.bar.update(self.bar_task, completed=step, stats=format_values(values))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.writer is not None:
            self.writer.close()
