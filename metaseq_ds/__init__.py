"""metaseq-ds: metaseq (the fairseq fork that trained OPT) rebuilt on DeepSpeed.

This module stays import-light (no torch, no deepspeed) so that `mseq --help` starts
instantly; the public sub-packages (`models`, `tasks`, `criterions`, `optim`, `data`, ...)
import what they need.
"""

__version__ = "0.1.0"
