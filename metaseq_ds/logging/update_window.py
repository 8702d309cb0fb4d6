"""Per-update training stats accumulated between two `train_inner` log lines, as metaseq's line.

Keys are metaseq's (tools parse them): epoch, update, loss (bits per token), ppl (2 ** loss),
wps, ups, wpb, bsz, num_updates, lr, gnorm, clip, train_wall, wall.
"""

import time
from typing import Any, Dict


def perplexity(loss_in_bits: float) -> float:
    """2 ** loss; inf where that overflows (a diverging run must not crash its log line)."""
    try:
        return 2.0**loss_in_bits
    except OverflowError:
        return float("inf")


class UpdateWindow:
    """Accumulates `Trainer.train_step` stats until `flush` turns them into one log line."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.loss = self.tokens = self.sentences = self.gnorm = self.clip = self.train_wall = 0.0
        self.started = time.perf_counter()

    def add(self, stats: Dict[str, float]) -> None:
        self.count += 1
        self.loss += stats["loss"] * stats["ntokens"]
        self.tokens += stats["ntokens"]
        self.sentences += stats["nsentences"]
        self.gnorm += stats["gnorm"]
        self.clip += stats["clip"]
        self.train_wall += stats["train_wall"]

    def flush(self, epoch: int, num_updates: int, lr: float, wall: float) -> Dict[str, Any]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        loss = self.loss / max(self.tokens, 1.0)
        out = {
            "epoch": epoch, "update": num_updates, "loss": loss, "ppl": perplexity(loss),
            "wps": self.tokens / elapsed, "ups": self.count / elapsed, "wpb": self.tokens / self.count,
            "bsz": self.sentences / self.count, "num_updates": num_updates, "lr": lr,
            "gnorm": self.gnorm / self.count, "clip": self.clip / self.count,
            "train_wall": self.train_wall, "wall": wall,
        }
        self.reset()
        return out
