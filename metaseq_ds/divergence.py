"""A diverging run stops with one line: an update whose loss, perplexity or gradient norm is not
finite ends `mseq train` before it is logged or saved, so the last checkpoint stays the last good one.

    mseq train DATA --lr 1e4 --clip-norm 0
    mseq train: error: update 3: loss 4.317e+08 bits per token (perplexity inf), gradient norm
    5.672e+04: the run diverged and stopped without saving (...). Likely causes: --lr 10000 is too
    high; --clip-norm 0 does not clip (1.0 is usual); precision is fp32, so not a reduced-precision
    overflow                                                                          (exit code 3)

The updates are checked when the log line reads them from the device (every --log-interval
updates; a read per update would be a host sync per update on a GPU), and before any validation
or save: a diverged update stops the run at the next of those, named by its own number.

The perplexity counts: a run can diverge without a NaN (Adam's steps stay finite however large
the learning rate), and 2 ** (bits per token) overflows only beyond 1024 bits per token, a mean
probability of the right token below the smallest float64: no model that learns gets there.

Reduced precision: when DeepSpeed's overflow check skipped the step (fp16's loss scaler lowers
its scale; bf16 under ZeRO skips too), the weights are untouched and the run goes on, as DeepSpeed
intends; a non-finite gradient stops the run only if the step applied it.
"""

import math
from typing import Any, Mapping, Optional

from metaseq_ds.errors import UsageError
from metaseq_ds.logging.metrics import get_perplexity


class TrainingDiverged(UsageError):
    """The update's loss, perplexity or gradient norm is not finite. Exit code 3: apart from usage
    errors (2) and crashes (1), so a scheduler can tell a run to retune from one to fix or rerun."""

    exit_code = 3


def check_update(stats: Mapping[str, Any], num_updates: int, cfg, last_saved: Optional[int]) -> None:
    """Raise `TrainingDiverged` if update `num_updates` (its `Trainer.train_step` stats) diverged.

    Every rank reaches the same verdict: the sums are over all ranks and the gradient norm is global.
    """
    loss, gnorm = stats["loss"], stats["gnorm"]
    # The loss is per unit of the criterion's sample size (a sentence, for some); the perplexity is per token.
    bits_per_token = loss * stats["sample_size"] / max(stats["ntokens"], 1)
    ppl = get_perplexity(bits_per_token, round=None)
    if math.isfinite(loss) and math.isfinite(ppl) and (math.isfinite(gnorm) or not stats["step_applied"]):
        return
    raise TrainingDiverged(
        f"update {num_updates}: loss {bits_per_token:.4g} bits per token (perplexity {ppl:g}), gradient norm "
        f"{gnorm:.4g}: the run diverged and stopped without saving ({_kept(cfg, last_saved)}). "
        f"Likely causes: {_causes(cfg)}"
    )


def _kept(cfg, last_saved: Optional[int]) -> str:
    if cfg.checkpoint.no_save:
        return "nothing is saved with --no-save"
    if last_saved is None:
        return "no checkpoint was saved"
    return f"the last checkpoint, update {last_saved}, is left as it was"


def _causes(cfg) -> str:
    clip = cfg.optimization.clip_norm
    clipping = "--clip-norm 0 does not clip (1.0 is usual)" if clip == 0 else f"--clip-norm {clip:g} is loose"
    common = cfg.common
    precision = ("bf16" if common.bf16 else "fp16") if common.bf16 or common.fp16 else None
    overflow = (f"{precision} overflows where fp32 would not (drop --{precision})" if precision
                else "precision is fp32, so not a reduced-precision overflow")
    return f"--lr {cfg.optimization.lr:g} is too high; {clipping}; {overflow}"
