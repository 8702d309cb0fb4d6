"""`adam`: Adam with decoupled weight decay (AdamW), as metaseq's MetaseqAdam.

Four implementations of the same update, chosen by `--adam-impl`: torch's AdamW with its
fused kernel (one pass over each tensor, on the CPU and CUDA; the default, `auto`: ~5x faster
than the for-loop AdamW on the CPU, what Hugging Face's Trainer picks, and nothing to compile),
DeepSpeed's FusedAdam (CUDA), DeepSpeed's CPUAdam (the fast one under ZeRO CPU offload) and
torch's plain for-loop AdamW. DeepSpeed's two are JIT-built on first use, which can fail (a
torch whose CUDA arch list DeepSpeed cannot parse, no nvcc): `check_kernels` builds them before
a run writes anything, and a failed build is one line naming the cause and the remedies.
DeepSpeed is imported only when one of its kernels is chosen, since loading its ops is slow.
"""

import logging
from dataclasses import dataclass, field
from typing import Annotated, Literal, Tuple

import torch
from pydantic import Field

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import NonNegativeFloat, PositiveFloat
from metaseq_ds.errors import UsageError
from metaseq_ds.optim.base_optimizer import BaseOptimizer
from metaseq_ds.optim.registry import register_optimizer

logger = logging.getLogger(__name__)

# --adam-impl -> (DeepSpeed op builder, the optimizer class it backs)
DEEPSPEED_KERNELS = {"fused": ("FusedAdamBuilder", "FusedAdam"), "cpu_adam": ("CPUAdamBuilder", "DeepSpeedCPUAdam")}


Beta = Annotated[float, Field(ge=0, lt=1)]  # a moment's decay: 1 would never forget


@dataclass
class MetaseqAdamConfig(MetaseqDataclass):
    adam_betas: Tuple[Beta, Beta] = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: PositiveFloat = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer"})
    weight_decay: NonNegativeFloat = field(default=0.0, metadata={"help": "weight decay, decoupled from the gradient (AdamW)"})
    adam_impl: Literal["auto", "torch", "torch_fused", "fused", "cpu_adam"] = field(
        default="auto",
        metadata={
            "help": "auto (= torch_fused): torch AdamW's fused kernel, on the CPU and CUDA, nothing to build; "
            "torch: torch AdamW's for-loop; fused: DeepSpeed FusedAdam (CUDA); cpu_adam: DeepSpeed CPUAdam, "
            "for --cpu-offload (both compiled on first use)"
        },
    )
    use_old_adam: bool = field(
        default=False, metadata={"help": "metaseq flag: use the unfused Adam; same as --adam-impl torch"}
    )
    fp16_adam_stats: bool = field(
        default=False,
        metadata={"help": "metaseq flag (fp16 Adam moments); no effect: DeepSpeed keeps optimizer state in fp32"},
    )
    lr: PositiveFloat = field(default=0.25, metadata={"help": "same as --lr"})


@register_optimizer("adam", dataclass=MetaseqAdamConfig)
class MetaseqAdam(BaseOptimizer):
    """Adam with AdamW's weight decay: p -= lr * weight_decay * p, apart from the Adam step."""

    def __init__(self, cfg: MetaseqAdamConfig, params):
        super().__init__(cfg)
        if cfg.fp16_adam_stats:
            logger.warning("--fp16-adam-stats has no effect: DeepSpeed keeps Adam moments in fp32")
        impl = self.implementation
        logger.info(f"adam implementation: {impl}")
        if impl == "fused":
            from deepspeed.ops.adam import FusedAdam

            self._optimizer = FusedAdam(params, adam_w_mode=True, **self.optimizer_config)
        elif impl == "cpu_adam":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self._optimizer = DeepSpeedCPUAdam(params, adamw_mode=True, **self.optimizer_config)
        else:
            self._optimizer = torch.optim.AdamW(params, fused=impl == "torch_fused", **self.optimizer_config)

    @property
    def implementation(self) -> str:
        return adam_implementation(self.cfg)

    @classmethod
    def check_kernels(cls, cfg: MetaseqAdamConfig) -> None:
        """Build DeepSpeed's kernel now if one is asked for: a failed build stops the run before
        it has written anything (`UsageError`: one line, exit code 2)."""
        impl = adam_implementation(cfg)
        if impl in DEEPSPEED_KERNELS:
            load_deepspeed_kernel(impl)

    @property
    def optimizer_config(self):
        return {
            "lr": self.cfg.lr,
            "betas": tuple(self.cfg.adam_betas),
            "eps": self.cfg.adam_eps,
            "weight_decay": self.cfg.weight_decay,
        }


def adam_implementation(cfg: MetaseqAdamConfig) -> str:
    """The kernel that `--adam-impl` (and metaseq's `--use-old-adam`) resolve to.

    `auto` is torch's fused AdamW everywhere: it needs no compilation, so a run starts on any
    machine, and on CUDA it is the kernel Hugging Face's Trainer uses. DeepSpeed's FusedAdam is
    the same multi-tensor update; it stays a choice (`--adam-impl fused`), not the default.
    """
    if cfg.use_old_adam:
        return "torch"
    if cfg.adam_impl == "auto":
        return "torch_fused"
    return cfg.adam_impl


def load_deepspeed_kernel(impl: str) -> None:
    """JIT-build (or load the cached build of) DeepSpeed's kernel for `--adam-impl impl`."""
    from deepspeed.ops import op_builder

    builder_name, optimizer_name = DEEPSPEED_KERNELS[impl]
    try:
        getattr(op_builder, builder_name)().load(verbose=False)
    except (Exception, SystemExit) as error:  # DeepSpeed's builders raise anything, or exit
        cause = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        remedies = "use --adam-impl torch_fused (torch's fused AdamW: nothing to build)"
        if torch.cuda.is_available():
            remedies = ("set TORCH_CUDA_ARCH_LIST to your GPU's compute capability (e.g. TORCH_CUDA_ARCH_LIST=9.0 "
                        "on an H100 or H200) and retry, or " + remedies)
        raise UsageError(f"--adam-impl {impl}: DeepSpeed's {optimizer_name} kernel did not build ({cause}); "
                         f"{remedies}") from None
