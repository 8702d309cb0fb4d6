"""The config tree of a training run: fixed sections plus one section per chosen component.

Field names are metaseq's, so `--max-update`, `--batch-size`, `--update-freq` ... mean what
they meant there. Values derived from other sections are computed in code (see
`metaseq_ds.options`), never interpolated between sections.
"""

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Optional

from pydantic import Field

from metaseq_ds.dataclass.base import MetaseqDataclass
from metaseq_ds.dataclass.constraints import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Seed


@dataclass
class CommonConfig(MetaseqDataclass):
    seed: Seed = field(default=1, metadata={"help": "random seed: model init, data order, dropout"})
    log_format: Literal["json", "simple", "none"] = field(
        default="json", metadata={"help": "format of the log lines (json: metaseq's JSON lines)"}
    )
    log_interval: PositiveInt = field(default=100, metadata={"help": "log training metrics every N updates"})
    log_file: Optional[str] = field(default=None, metadata={"help": "also append the log lines to this file"})
    tensorboard_logdir: Optional[str] = field(
        default=None, metadata={"help": "write TensorBoard scalars under this directory"}
    )
    bf16: bool = field(default=False, metadata={"help": "train in bfloat16 (DeepSpeed bf16; fp32 master weights)"})
    fp16: bool = field(
        default=False,
        metadata={"help": "train in float16 with loss scaling; on CPU (no fp16 support) falls back to bf16 with a warning"},
    )
    memory_efficient_fp16: bool = field(
        default=False, metadata={"help": "metaseq flag; same as --fp16 here (DeepSpeed keeps fp32 master weights)"}
    )
    memory_efficient_bf16: bool = field(default=False, metadata={"help": "metaseq flag; same as --bf16 here"})
    fp16_init_scale: PositiveInt = field(default=2**7, metadata={"help": "initial fp16 loss scale"})
    cpu: bool = field(default=False, metadata={"help": "use the CPU even when an accelerator is present"})
    user_dir: Optional[str] = field(
        default=None, metadata={"help": "a Python package of plugins (models, tasks, ...) to import before parsing"}
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "print what each rank will hold (weights, gradients, optimizer, activations) for "
                          "--distributed-world-size ranks and exit; nothing is built or started"},
    )
    progress_bar: Literal["auto", "rich", "none"] = field(
        default="auto", metadata={"help": "rich progress bar: auto = only when stdout is a terminal"}
    )


@dataclass
class DistributedTrainingConfig(MetaseqDataclass):
    zero_stage: Optional[Annotated[int, Field(ge=0, le=3)]] = field(
        default=None,
        metadata={"help": "DeepSpeed ZeRO stage 0-3 (default: 0 for one process, 3 for several: the FSDP equivalent)"},
    )
    deepspeed_config: Optional[str] = field(
        default=None,
        metadata={"help": "a DeepSpeed JSON file or a preset name (zero1, zero2, zero3, zero3_offload); what it sets overrides the derived config"},
    )
    ddp_backend: Literal["c10d", "pytorch_ddp", "legacy_ddp", "no_c10d", "fully_sharded"] = field(
        default="pytorch_ddp",
        metadata={"help": "metaseq flag: fully_sharded means ZeRO-3 here; the DDP choices mean ZeRO-0"},
    )
    use_sharded_state: bool = field(
        default=False, metadata={"help": "metaseq flag; DeepSpeed always saves ZeRO shards per rank, so this is implied"}
    )
    cpu_offload: bool = field(default=False, metadata={"help": "offload optimizer state to CPU (ZeRO offload)"})
    checkpoint_activations: bool = field(
        default=False, metadata={"help": "recompute activations in the backward pass to save memory"}
    )
    compile_layers: bool = field(
        default=False,
        metadata={"help": "torch.compile each decoder layer (one graph, shared by all layers; compiled at the "
                          "first update). Off by default: slower on the CPU (benchmarks/RESULTS.md)"},
    )
    model_parallel_size: PositiveInt = field(
        default=1, metadata={"help": "tensor-parallel degree (metaseq name); see also --tensor-parallel-size"}
    )
    tensor_parallel_size: PositiveInt = field(default=1, metadata={"help": "tensor-parallel degree"})
    distributed_port: Annotated[int, Field(ge=-1, le=65535)] = field(
        default=-1,
        metadata={"help": "port for the single-process rendezvous when no launcher set MASTER_PORT (-1 or 0: a free one)"},
    )
    local_rank: Annotated[int, Field(ge=-1)] = field(default=-1, metadata={"help": "set by the deepspeed launcher; not for users"})
    distributed_world_size: Optional[PositiveInt] = field(
        default=None,
        metadata={"help": "metaseq flag; the launcher decides the world size here (a mismatch is an error); "
                          "with --dry-run, the number of ranks to plan for"}
    )


@dataclass
class DatasetConfig(MetaseqDataclass):
    batch_size: PositiveInt = field(default=8, metadata={"help": "sequences per micro-batch on each rank"})
    batch_size_valid: Optional[PositiveInt] = field(default=None, metadata={"help": "validation batch size (default: --batch-size)"})
    num_workers: NonNegativeInt = field(
        default=0,
        metadata={"help": "DataLoader worker processes preparing batches ahead of the step (0: a background thread)"},
    )
    valid_subset: str = field(default="valid", metadata={"help": "comma-separated validation splits"})
    validate_interval: PositiveInt = field(default=1, metadata={"help": "validate every N epochs"})
    validate_interval_updates: NonNegativeInt = field(default=0, metadata={"help": "validate every N updates (0: off)"})
    disable_validation: bool = field(default=False, metadata={"help": "never validate"})
    max_valid_steps: Optional[PositiveInt] = field(default=None, metadata={"help": "at most N validation batches per split"})
    data_buffer_size: NonNegativeInt = field(
        default=10, metadata={"help": "batches prepared ahead of the step (0: each made when the step asks)"}
    )
    demo: bool = field(
        default=False,
        metadata={"help": "train on the embedded demo corpus (Python's standard library sources, written to "
                          "data/demo_corpus) with the demo's defaults; what `mseq train` without DATA does"},
    )


@dataclass
class OptimizationConfig(MetaseqDataclass):
    max_update: NonNegativeInt = field(default=0, metadata={"help": "stop after N updates (0: no limit)"})
    max_epoch: NonNegativeInt = field(default=0, metadata={"help": "stop after N epochs (0: no limit)"})
    update_freq: PositiveInt = field(default=1, metadata={"help": "accumulate gradients over N micro-batches per update"})
    lr: PositiveFloat = field(default=0.25, metadata={"help": "peak learning rate"})
    clip_norm: NonNegativeFloat = field(default=0.0, metadata={"help": "clip the global gradient norm to this (0: no clipping)"})
    # Any finite threshold is meaningful (a negative one never stops), so it has no range.
    stop_min_lr: float = field(
        default=-1.0, metadata={"help": "stop when the learning rate falls below this (negative: never)"}
    )


@dataclass
class CheckpointConfig(MetaseqDataclass):
    save_dir: str = field(default="checkpoints", metadata={"help": "where checkpoints go"})
    restore_file: str = field(
        default="checkpoint_last", metadata={"help": "checkpoint to resume from: a tag in --save-dir or a path"}
    )
    save_interval_updates: NonNegativeInt = field(default=0, metadata={"help": "save every N updates (0: only at epoch ends)"})
    save_interval: PositiveInt = field(default=1, metadata={"help": "save every N epochs"})
    keep_last_updates: Annotated[int, Field(ge=-1)] = field(default=-1, metadata={"help": "keep only the last N update checkpoints (-1: all)"})
    no_save: bool = field(
        default=False,
        metadata={"help": "save no checkpoints, and do not resume from --save-dir's checkpoint_last "
                          "(an explicit --restore-file is still restored)"},
    )
    no_epoch_checkpoints: bool = field(default=False, metadata={"help": "no checkpoints at epoch ends"})
    reset_optimizer: bool = field(default=False, metadata={"help": "when restoring, do not load optimizer state"})
    reset_lr_scheduler: bool = field(default=False, metadata={"help": "when restoring, do not load LR scheduler state"})
    reset_dataloader: bool = field(default=False, metadata={"help": "when restoring, restart the data iterator"})
    reset_meters: bool = field(default=False, metadata={"help": "when restoring, reset the meters"})


# Not sections of a training run: the flags of scripts built on `options.get_generation_parser`.
@dataclass
class GenerationConfig(MetaseqDataclass):
    """metaseq's generation flags; `BaseTask.build_generator` turns them into `GenerationOptions`
    (which `mseq generate` takes directly, under the OpenAI names)."""

    path: Optional[str] = field(default=None, metadata={"help": "the checkpoint to generate with (metaseq's --path)"})
    beam: PositiveInt = field(
        default=5,
        metadata={"help": "completions per prompt, best first: the beams of a beam search at --temperature 0, "
                          "independent samples above it (as metaseq's --beam)"},
    )
    max_len_b: PositiveInt = field(
        default=200, metadata={"help": "at most N new tokens (metaseq counted the prompt in this length too)"}
    )
    min_len: NonNegativeInt = field(default=1, metadata={"help": "at least N new tokens before </s> may end a completion"})
    sampling: bool = field(
        default=False,
        metadata={"help": "allow --sampling-topp / --sampling-topk (the temperature decides between sampling and search)"},
    )
    sampling_topp: float = field(
        default=-1.0, metadata={"help": "sample from the most probable tokens up to this mass, in (0, 1] (-1: off)"}
    )
    sampling_topk: int = field(default=-1, metadata={"help": "sample among the K most probable tokens (-1: off)"})
    temperature: NonNegativeFloat = field(
        default=1.0, metadata={"help": "sampling temperature; 0 decodes greedily (beam search with --beam > 1)"}
    )
    lenpen: float = field(default=1.0, metadata={"help": "beam scores are divided by length ** this"})


@dataclass
class InteractiveConfig(MetaseqDataclass):
    """fairseq's interactive flags (`options.get_generation_parser(interactive=True)`)."""

    buffer_size: NonNegativeInt = field(
        default=0, metadata={"help": "read this many prompts into a buffer before generating"}
    )
    input: str = field(default="-", metadata={"help": "file to read prompts from (-: standard input)"})


@dataclass
class MetaseqConfig(MetaseqDataclass):
    """A whole run's config. The component sections hold the chosen component's dataclass."""

    common: CommonConfig = field(default_factory=CommonConfig)
    distributed_training: DistributedTrainingConfig = field(default_factory=DistributedTrainingConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    optimization: OptimizationConfig = field(default_factory=OptimizationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    model: Any = None
    task: Any = None
    criterion: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    arch: Optional[str] = field(default=None, metadata={"help": "the --arch the model section was resolved from"})

    def to_dict(self):
        """Nested plain dict; component sections carry their registry name as `_name`."""
        out = {"arch": self.arch}
        for name in FIXED_SECTIONS + COMPONENT_SECTIONS:
            section = getattr(self, name)
            if section is not None:
                out[name] = section.to_dict()
                if name in COMPONENT_SECTIONS:
                    out[name]["_name"] = section._name
        return out


FIXED_SECTIONS = ["common", "distributed_training", "dataset", "optimization", "checkpoint"]
COMPONENT_SECTIONS = ["model", "task", "criterion", "optimizer", "lr_scheduler"]

