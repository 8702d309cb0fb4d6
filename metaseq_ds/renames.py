"""The rename table: fairseq's and metaseq's names -> metaseq_ds's, as data.

Two users read it and nothing else: `compat` (aliases and the `import fairseq` hook) and
`migrate` (the codemod behind `mseq migrate`); `docs/migration.md` is generated from it
(`python -m migrate.docs --write`). `tests/test_renames.py` checks that every target
resolves in the installed `metaseq_ds`. This module imports nothing heavy: `mseq migrate`
and `compat.install()` read it without torch.

Three parts:
- `CLASS_RENAMES`: the class renames of metaseq's docs/history.md, old qualified name (where
  fairseq defined it) -> new qualified name. An old class name is renamed wherever it is
  imported from (fairseq re-exported these from several modules).
- `PACKAGE_RENAMES`: top-level packages; a module not listed in `MODULE_MOVES` keeps its path
  under the new package (`fairseq.models.transformer_lm` -> `metaseq_ds.models.transformer_lm`).
- `MODULE_MOVES`: modules whose path changed between fairseq's, metaseq's and our layouts.
- `NOT_PROVIDED`: parts of fairseq's and metaseq's plugin surface metaseq_ds leaves out on
  purpose, each with the reason and what to do; `mseq migrate` reports them as needing a person.
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class ClassRename:
    old: str  # qualified name where fairseq (or metaseq) defined it
    new: str  # qualified name in metaseq_ds

    @property
    def old_name(self) -> str:
        return self.old.rsplit(".", 1)[1]

    @property
    def new_name(self) -> str:
        return self.new.rsplit(".", 1)[1]

    @property
    def new_module(self) -> str:
        return self.new.rsplit(".", 1)[0]


CLASS_RENAMES: Tuple[ClassRename, ...] = (
    ClassRename("fairseq.optim.fairseq_optimizer.FairseqOptimizer", "metaseq_ds.optim.BaseOptimizer"),
    ClassRename("fairseq.optim.fairseq_optimizer.LegacyFairseqOptimizer", "metaseq_ds.optim.LegacyOptimizer"),
    ClassRename("fairseq.optim.lr_scheduler.fairseq_lr_scheduler.FairseqLRScheduler", "metaseq_ds.optim.lr_scheduler.BaseLRScheduler"),
    ClassRename("fairseq.criterions.fairseq_criterion.FairseqCriterion", "metaseq_ds.criterions.BaseCriterion"),
    ClassRename("fairseq.incremental_decoding_utils.FairseqIncrementalState", "metaseq_ds.incremental_decoding_utils.IncrementalState"),
    ClassRename("fairseq.optim.adam.FairseqAdam", "metaseq_ds.optim.adam.MetaseqAdam"),
    ClassRename("fairseq.optim.adam.FairseqAdamConfig", "metaseq_ds.optim.adam.MetaseqAdamConfig"),
    ClassRename("metaseq.optim.sgd.FairseqSGDW", "metaseq_ds.optim.sgd.MetaseqSGDW"),
    ClassRename("fairseq.modules.fairseq_dropout.FairseqDropout", "metaseq_ds.modules.Dropout"),
    ClassRename("fairseq.models.fairseq_decoder.FairseqDecoder", "metaseq_ds.models.BaseDecoder"),
    ClassRename("fairseq.models.fairseq_incremental_decoder.FairseqIncrementalDecoder", "metaseq_ds.models.BaseDecoder"),
    ClassRename("fairseq.models.fairseq_encoder.FairseqEncoder", "metaseq_ds.models.BaseEncoder"),
    ClassRename("fairseq.models.distributed_fairseq_model.DistributedFairseqModel", "metaseq_ds.models.DistributedModel"),
    ClassRename("fairseq.models.fairseq_model.BaseFairseqModel", "metaseq_ds.models.BaseModel"),
    ClassRename("fairseq.models.fairseq_model.FairseqEncoderDecoderModel", "metaseq_ds.models.EncoderDecoderModel"),
    ClassRename("fairseq.models.fairseq_model.FairseqLanguageModel", "metaseq_ds.models.LanguageModel"),
    ClassRename("fairseq.tasks.fairseq_task.FairseqTask", "metaseq_ds.tasks.BaseTask"),
    ClassRename("fairseq.tasks.fairseq_task.LegacyFairseqTask", "metaseq_ds.tasks.LegacyTask"),
    ClassRename("fairseq.dataclass.configs.FairseqDataclass", "metaseq_ds.dataclass.MetaseqDataclass"),
    ClassRename("fairseq.dataclass.configs.FairseqConfig", "metaseq_ds.dataclass.MetaseqConfig"),
    ClassRename("fairseq.data.fairseq_dataset.FairseqDataset", "metaseq_ds.data.BaseDataset"),
)

PACKAGE_RENAMES: Dict[str, str] = {
    "fairseq": "metaseq_ds",
    "metaseq": "metaseq_ds",
    "fairseq_cli": "metaseq_ds.cli",
    "metaseq_cli": "metaseq_ds.cli",  # metaseq's first releases kept fairseq's layout
}

MODULE_MOVES: Dict[str, str] = {
    # fairseq defined each base class in a module of its own; metaseq_ds exports them from the package
    "fairseq.models.fairseq_decoder": "metaseq_ds.models",
    "fairseq.models.fairseq_incremental_decoder": "metaseq_ds.models",
    "fairseq.models.fairseq_encoder": "metaseq_ds.models",
    "fairseq.models.fairseq_model": "metaseq_ds.models",
    "fairseq.models.distributed_fairseq_model": "metaseq_ds.models",
    "fairseq.tasks.fairseq_task": "metaseq_ds.tasks.base_task",
    "fairseq.criterions.fairseq_criterion": "metaseq_ds.criterions.base_criterion",
    "fairseq.optim.fairseq_optimizer": "metaseq_ds.optim.base_optimizer",
    "fairseq.optim.lr_scheduler.fairseq_lr_scheduler": "metaseq_ds.optim.lr_scheduler.base_lr_scheduler",
    "fairseq.modules.fairseq_dropout": "metaseq_ds.modules.dropout",
    "fairseq.data.fairseq_dataset": "metaseq_ds.data.base_dataset",
    # metaseq's names for the same modules
    "metaseq.models.base_decoder": "metaseq_ds.models",
    "metaseq.models.base_encoder": "metaseq_ds.models",
    "metaseq.models.base_model": "metaseq_ds.models",
    "metaseq.models.incremental_decoder": "metaseq_ds.models",
    "metaseq.models.distributed_model": "metaseq_ds.models",
    # fairseq's flat top-level modules that later moved into packages
    "fairseq.distributed_utils": "metaseq_ds.distributed.utils",
    "fairseq.meters": "metaseq_ds.logging.meters",
    "fairseq.metrics": "metaseq_ds.logging.metrics",
    "fairseq.progress_bar": "metaseq_ds.logging.progress_bar",
    # checkpoints are one package here (planning, saving, restoring, consolidating, resharding)
    "fairseq.checkpoint_utils": "metaseq_ds.checkpoint",
    "metaseq.checkpoint_utils": "metaseq_ds.checkpoint",
}

# Old names (after the package: "utils.parse_embedding" is fairseq's and metaseq's) that metaseq_ds
# does not provide, on purpose: why, and what to use. A module entry covers every name in it.
NOT_PROVIDED: Dict[str, str] = {
    "tasks.language_modeling": "fairseq's LM task reads fairseq-preprocess binaries (dict.txt + .bin/.idx), "
    "which metaseq_ds does not read; extend metaseq_ds.tasks.streaming_language_modeling (jsonl, metaseq's task)",
    "checkpoint_utils.load_checkpoint_to_cpu": "checkpoints are DeepSpeed tag directories, not one pickle; "
    "metaseq_ds.checkpoint.inference.load_model_for_inference(path) gives (cfg, task, model, ref)",
    "checkpoint_utils.load_model_ensemble_and_task": "one model per checkpoint: "
    "metaseq_ds.checkpoint.inference.load_model_for_inference(path) gives (cfg, task, model, ref)",
    "utils.parse_embedding": "pretrained word-vector files for translation embeddings (metaseq dropped them)",
    "utils.load_embedding": "pretrained word-vector files for translation embeddings (metaseq dropped them)",
    "utils.print_embed_overlap": "pretrained word-vector files for translation embeddings (metaseq dropped them)",
    "utils.load_align_dict": "translation's unknown-word replacement and alignment",
    "utils.replace_unk": "translation's unknown-word replacement and alignment",
    "utils.post_process_prediction": "translation's unknown-word replacement and alignment",
    "utils.extract_hard_alignment": "translation's unknown-word replacement and alignment",
    "utils.extract_soft_alignment": "translation's unknown-word replacement and alignment",
    "utils.parse_alignment": "translation's unknown-word replacement and alignment",
    "utils.convert_padding_direction": "encoder padding flips and non-autoregressive translation",
    "utils.new_arange": "encoder padding flips and non-autoregressive translation",
    "utils.move_to_tpu": "no TPU/XLA support",
    "utils.get_tpu_device": "no TPU/XLA support",
    "utils.tpu_data_loader": "no TPU/XLA support",
    "utils.xla_device_to_cpu": "no TPU/XLA support",
    "utils.is_xla_tensor": "no TPU/XLA support",
    "utils.multi_tensor_l2_total_norm": "needs apex's amp_C; utils.clip_grad_norm_ uses torch's multi-tensor norm",
    "utils.get_model_init_dtype": "picked a dtype for FairScale's memory-efficient fp16; DeepSpeed's config decides here",
    "utils.floating_point_precision_convertor": "FairScale's memory-efficient fp16; DeepSpeed's config decides here",
    "utils.init_method_normal": "draws from the global RNG; metaseq_ds initialises each parameter from its own "
    "generator (model.reset_parameter), so weights do not depend on the parallel layout",
    "utils.scaled_init_method_normal": "draws from the global RNG; metaseq_ds initialises each parameter from its "
    "own generator (model.reset_parameter), so weights do not depend on the parallel layout",
    "utils.CudaEnvironment": "only logged per-worker GPU details",
    "utils.swiglu": "a gated activation needs a second linear layer: not a function of one tensor",
    "utils.geglu": "a gated activation needs a second linear layer: not a function of one tensor",
    "options.get_eval_lm_parser": "`mseq validate --path CKPT` evaluates a checkpoint",
    "options.get_validation_parser": "`mseq validate --path CKPT` evaluates a checkpoint",
    "options.get_preprocessing_parser": "no binarisation step: `mseq preprocess` tokenizes jsonl into token stores",
    "options.get_interactive_generation_parser": "`mseq generate` reads prompts from stdin or a file; "
    "options.get_generation_parser is provided",
    "options.add_dataset_args": "flags come from the config dataclasses: "
    "options.gen_parser_from_dataclass(parser, config) adds a section's",
    "options.add_distributed_training_args": "flags come from the config dataclasses: "
    "options.gen_parser_from_dataclass(parser, config) adds a section's",
    "options.add_optimization_args": "flags come from the config dataclasses: "
    "options.gen_parser_from_dataclass(parser, config) adds a section's",
    "options.add_checkpoint_args": "flags come from the config dataclasses: "
    "options.gen_parser_from_dataclass(parser, config) adds a section's",
    "options.add_model_args": "flags come from the config dataclasses: "
    "options.gen_parser_from_dataclass(parser, config) adds a section's",
    "options.add_generation_args": "flags come from the config dataclasses: "
    "options.gen_parser_from_dataclass(parser, config) adds a section's",
    "dataclass.utils.convert_namespace_to_omegaconf": "no OmegaConf: options.parse_train_config(argv) gives the "
    "validated config that setup_task and build_model take",
}

# Members of the old base classes that metaseq_ds's leave out: `mseq migrate` cannot see a
# method called on `self`, so these are listed in docs/migration.md only.
NOT_PROVIDED_MEMBERS: Dict[str, str] = {
    "tasks.FairseqTask.build_dataset_for_inference": "seq2seq (source sentences to translate)",
    "tasks.FairseqTask.get_interactive_tokens_and_lengths": "needs Dictionary.encode_line; the task's tokenizer "
    "(task.tokenize) replaces it",
    "tasks.FairseqTask.get_batch_iterator(dataset, max_tokens, ...)": "the old signature: metaseq_ds's iterator is "
    "per split (task.get_batch_iterator(split, batch_size, ...)) and resumes by seeking",
    "tasks.FairseqTask.dataset_to_epoch_iter / can_reuse_epoch_itr": "the same iterator, per split",
    "tasks.FairseqTask.optimizer_step": "the DeepSpeed engine owns the step",
    "tasks.FairseqTask.aggregate_logging_outputs": "fairseq's legacy path; reduce_metrics is called (metaseq's)",
    "tasks.FairseqTask.build_generator: diverse beam, constraints, prefix_allowed_tokens_fn, SequenceScorer, "
    "no_repeat_ngram_size, --max-len-a": "seq2seq search and scoring options that metaseq's generator ignores too",
    "models.transformer_lm.base_lm_architecture: decoder_normalize_before": "fairseq's forced pre-LN "
    "(decoder_normalize_before = True); metaseq's and ours leave it to the architecture: set it in yours",
}

# Command lines of fairseq's and metaseq's console scripts that `mseq` replaces.
COMMAND_RENAMES: Dict[str, str] = {
    "fairseq-train": "mseq train",
    "metaseq-train": "mseq train",
    "fairseq_cli.train": "mseq train",
    "metaseq_cli.train": "mseq train",
    "metaseq.cli.train": "mseq train",
    "fairseq-validate": "mseq validate",
    "metaseq-validate": "mseq validate",
    "fairseq_cli.validate": "mseq validate",
    "metaseq_cli.validate": "mseq validate",
    "metaseq.cli.validate": "mseq validate",
}

OLD_PACKAGES = tuple(PACKAGE_RENAMES)
CLASS_RENAME_BY_OLD_NAME: Dict[str, ClassRename] = {r.old_name: r for r in CLASS_RENAMES}


def is_old_module(dotted: str) -> bool:
    """Whether `dotted` lies in one of the packages that metaseq_ds replaces."""
    return dotted.split(".", 1)[0] in PACKAGE_RENAMES


def new_module_path(old_module: str) -> Tuple[str, int]:
    """The metaseq_ds path of an old module (by the longest listed prefix) and how many of
    its dotted parts that prefix consumed; the remaining parts keep their names."""
    parts = old_module.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        target = MODULE_MOVES.get(prefix) or PACKAGE_RENAMES.get(prefix)
        if target is not None:
            return ".".join([target, *parts[end:]]), end
    raise ValueError(f"{old_module} is not in a package that metaseq_ds replaces")


def class_rename(name: str) -> Optional[ClassRename]:
    return CLASS_RENAME_BY_OLD_NAME.get(name)


def not_provided(old: str) -> Optional[str]:
    """Why the old dotted name (or the module it lies in) is left out on purpose, or None."""
    parts = old.split(".")[1:]
    for end in range(len(parts), 0, -1):
        reason = NOT_PROVIDED.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None
