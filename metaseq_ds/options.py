"""From command line and config file to a validated, read-only `MetaseqConfig`.

Precedence: command line > `--config FILE` > the architecture's defaults > field defaults.
Flags are derived from the dataclass fields of the fixed sections and of the chosen
components (`--task`, `--arch`, `--criterion`, `--optimizer`, `--lr-scheduler`), so plugin
configs get flags for free. A component field named like a fixed-section field (`lr`,
`max_update`, `batch_size`, `seed`) receives that same value: metaseq expressed this with
`II("optimization.lr")` interpolation; here it is one rule in `_section_values`.

Every value is settled during validation (`build_config`: the demo run, values derived from
other sections) or by one explicit step for what the flags cannot know (`resolve`: facts of
the checkpoint a run resumes from). After that the config is read-only: assigning one of
metaseq_ds's own config fields raises. (Plugin configs stay assignable: fairseq-style plugin
code often sets fields of its own config while building.)

The end of the file keeps fairseq's and metaseq's parser functions for users' scripts
(`get_training_parser`, `get_generation_parser`, `parse_args_and_arch`; `gen_parser_from_dataclass`
is `metaseq_ds.dataclass.utils`'), which parse into an argparse namespace instead.
"""

import argparse
import dataclasses
import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from metaseq_ds.dataclass import (
    COMPONENT_SECTIONS, FIXED_SECTIONS, MetaseqConfig, make_read_only, validate_config, validate_value,
)
from metaseq_ds.dataclass.constraints import field_types, plain_type
from metaseq_ds.dataclass.utils import field_help, flag, gen_parser_from_dataclass, option_names, value_from_text
from metaseq_ds.errors import UsageError
from metaseq_ds.registry import Registry, closest

DEFAULT_COMPONENTS = {
    "task": "streaming_language_modeling",
    "arch": "transformer_lm_gpt2_tiny",
    "criterion": "cross_entropy",
    "optimizer": "adam",
    "lr_scheduler": "inverse_sqrt",
}

# `mseq train` with no data (or --demo) trains on the embedded demo corpus, written here, with
# these defaults; explicit values still win.
DEMO_DATA_DIR = "data/demo_corpus"
DEMO_DEFAULTS = {  # ~2 minutes on 2 CPU cores
    "max_update": 600,
    "lr": 1e-3,
    "warmup_updates": 50,
    "batch_size": 16,
    "tokens_per_sample": 128,
    "log_interval": 50,
    "validate_interval_updates": 200,
    "save_interval_updates": 200,
    "max_valid_steps": 20,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "clip_norm": 1.0,
}
DEMO_MODEL_DEFAULTS = {  # only when --arch is not given either
    "decoder_embed_dim": 128,
    "decoder_ffn_embed_dim": 512,
    "decoder_layers": 4,
    "decoder_attention_heads": 4,
}

# metaseq flags whose FSDP/Megatron meaning has no separate switch here: accepted, explained once.
METASEQ_ONLY_FLAGS = {
    "use_sharded_state": "DeepSpeed always saves per-rank ZeRO shards; --use-sharded-state is implied",
    "memory_efficient_fp16": "--memory-efficient-fp16 means --fp16 here (DeepSpeed keeps fp32 master weights)",
    "memory_efficient_bf16": "--memory-efficient-bf16 means --bf16 here",
    "distributed_world_size": "the launcher sets the world size; --distributed-world-size is only checked",
}


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What the flags alone cannot say, for `resolve`: facts of the checkpoint the run resumes from."""

    # The saved run's vocabulary padding factor: a run resumed at another tensor-parallel degree
    # keeps the saved padded vocabulary (its padding rows are trained already).
    restored_padding_factor: Optional[int] = None


def component_registries() -> Dict[str, Registry]:
    """The registries, imported here because they pull in torch (not on the `--help` path)."""
    from metaseq_ds import criterions, model_parallel, models, optim, tasks
    from metaseq_ds.optim import lr_scheduler

    del model_parallel  # imported for what it registers: metaseq's tensor-parallel model and criterion

    return {
        "task": tasks.TASK_REGISTRY,
        "model": models.MODEL_REGISTRY,
        "criterion": criterions.CRITERION_REGISTRY,
        "optimizer": optim.OPTIMIZER_REGISTRY,
        "lr_scheduler": lr_scheduler.LR_SCHEDULER_REGISTRY,
    }


def import_plugins(user_dir: Optional[str]) -> None:
    """Import the `--user-dir` package, if any, so that its components are registered."""
    if user_dir:
        from metaseq_ds.user_code import import_user_module, install_compat_if_asked

        install_compat_if_asked()  # plugins that `import fairseq`, under any launcher
        import_user_module(user_dir)


def parse_train_config(argv: Sequence[str]) -> MetaseqConfig:
    return TrainArgumentParser(argv).config()


class TrainArgumentParser:
    """Two passes, as fairseq's: find the components (and plugins), then parse their flags."""

    def __init__(self, argv: Sequence[str]):
        self.argv = _negative_values_attached(argv)
        pre = _ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--config")
        pre.add_argument("--user-dir")
        for name in DEFAULT_COMPONENTS:
            pre.add_argument(flag(name), *(["-a"] if name == "arch" else []))
        known, _ = pre.parse_known_args(self.argv)
        self.config_file = known.config
        self.file_values = load_config_file(Path(known.config)) if known.config else {}
        import_plugins(known.user_dir or self.file_values.get("user_dir"))
        self.registries = component_registries()
        from metaseq_ds import models

        self.models = models
        self.choice = {
            name: getattr(known, name) or self.file_values.get(name) or default
            for name, default in DEFAULT_COMPONENTS.items()
        }
        self.arch_given = known.arch is not None or "arch" in self.file_values
        self.section_classes = section_classes(self.choice)
        self.parser, self.owner = self._build_parser()

    def _build_parser(self) -> Tuple[argparse.ArgumentParser, Dict[str, str]]:
        parser = _ArgumentParser(
            prog="mseq train",
            description="Train an OPT-style language model on DeepSpeed (metaseq's flags).",
            argument_default=argparse.SUPPRESS,
            allow_abbrev=False,
        )
        parser.add_argument("--config", metavar="FILE", help="YAML or JSON file of flag values (the command line wins)")
        chooser = parser.add_argument_group("components")
        for name in DEFAULT_COMPONENTS:
            choices = sorted(self.models.ARCH_MODEL_REGISTRY) if name == "arch" else self.registries[name].choices()
            chooser.add_argument(
                flag(name), *(["-a"] if name == "arch" else []), metavar=name.upper(),
                help=f"default {DEFAULT_COMPONENTS[name]}; one of: {', '.join(choices)}",
            )
        owner: Dict[str, str] = {}  # field name -> first section defining it (its flag)
        for section, cls in self.section_classes.items():
            group = parser.add_argument_group(f"{section} ({cls.__name__})")
            for f in dataclasses.fields(cls):
                if f.name in owner or f.name in DEFAULT_COMPONENTS:
                    continue  # shared field: filled from the owner's flag
                owner[f.name] = section
                _add_field_argument(group, f, cls)
        return parser, owner

    def config(self) -> MetaseqConfig:
        namespace, extras = self.parser.parse_known_args(self.argv)
        for extra in extras:
            if extra.startswith("-"):
                option = extra.split("=", 1)[0]
                hint = closest(option, self.parser._option_string_actions)
                raise UsageError(f"unknown flag {option}{hint}")
            raise UsageError(f"unexpected argument {extra!r}")
        cli_values = {k: v for k, v in vars(namespace).items() if k not in ("config",) and k not in DEFAULT_COMPONENTS}
        unknown = set(self.file_values) - set(self.owner) - set(DEFAULT_COMPONENTS) - {"user_dir"}
        if unknown:
            key = sorted(unknown)[0]
            raise UsageError(f"{self.config_file}: unknown key {key!r}{closest(key, self.owner)}")
        explicit = self._with_demo({**self.file_values, **cli_values})
        for name, reason in METASEQ_ONLY_FLAGS.items():
            if name == "distributed_world_size" and explicit.get("dry_run"):
                continue  # --dry-run plans for that many ranks
            if explicit.get(name):
                warnings.warn(reason, stacklevel=2)
        return build_config(self.section_classes, explicit, arch=self.choice["arch"])

    def _with_demo(self, explicit: Dict[str, Any]) -> Dict[str, Any]:
        """The demo run, decided here once: no DATA (or --demo) means DEMO_DEFAULTS, recorded as
        `dataset.demo` (`resolve` then points the task at the corpus, which `mseq train` builds)."""
        task_has_data = "data" in self.section_classes["task"].__dataclass_fields__
        if explicit.get("demo") and explicit.get("data") is not None:
            raise UsageError(f"--demo trains on the embedded demo corpus: give DATA ({explicit['data']}) or --demo, not both")
        if not task_has_data or (explicit.get("data") is not None and not explicit.get("demo")):
            return explicit
        model_defaults = {} if self.arch_given else DEMO_MODEL_DEFAULTS
        return {**DEMO_DEFAULTS, **model_defaults, **explicit, "demo": True}

    def format_help(self) -> str:
        return self.parser.format_help()


class _ArgumentParser(argparse.ArgumentParser):
    """argparse, whose own errors ("expected one argument") become one UsageError line too."""

    def error(self, message: str):
        raise UsageError(message)


def _negative_values_attached(argv: Sequence[str]) -> List[str]:
    """`--lr -1e-3` as `--lr=-1e-3`: argparse takes '-1e-3' or '-inf' for a flag (only '-1' and
    '-0.5' look like numbers to it), so a value out of range would not even reach the check."""
    out: List[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and out[-1] != "--" and "=" not in out[-1] and _is_negative_number(token):
            out[-1] += "=" + token
        else:
            out.append(token)
    return out


def _is_negative_number(token: str) -> bool:
    if not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return False
    return True


def model_of_arch(arch: str) -> str:
    """The registered model that `--arch arch` builds."""
    from metaseq_ds import models

    if arch not in models.ARCH_MODEL_REGISTRY:
        raise UsageError(
            f"--arch: unknown architecture {arch!r}{closest(arch, models.ARCH_MODEL_REGISTRY)} "
            f"(choose from {', '.join(sorted(models.ARCH_MODEL_REGISTRY))})"
        )
    return models.ARCH_MODEL_REGISTRY[arch]


def section_classes(choice: Mapping[str, str]) -> Dict[str, type]:
    """The config class of every section, for chosen components ({"task": ..., "arch": ..., ...})."""
    registries = component_registries()
    classes = {name: MetaseqConfig.__dataclass_fields__[name].default_factory for name in FIXED_SECTIONS}
    for section in COMPONENT_SECTIONS:
        key = model_of_arch(choice["arch"]) if section == "model" else choice[section]
        entry = registries[section].get(key)
        if entry.dataclass is None:
            raise UsageError(f"{registries[section].flag} {key!r} has no config dataclass")
        classes[section] = entry.dataclass
    return classes


def build_config(classes: Dict[str, type], explicit: Dict[str, Any], arch: str) -> MetaseqConfig:
    """The validated, read-only config: `explicit` values (flag names as keys, the command line's
    strings or typed values), the arch's defaults around them, then values derived from others."""
    from metaseq_ds import models

    # Only the sections' fields are read from these: fairseq-style architecture functions also set
    # attributes no section has (fairseq's adaptive_input, ...), dropped here; unknown flags were
    # refused before, by the parser.
    explicit = {**explicit, **models.arch_defaults(arch, _typed(classes, explicit))}
    sections: Dict[str, Any] = {}
    for name in FIXED_SECTIONS + COMPONENT_SECTIONS:
        cls = classes[name]
        sections[name] = validate_config(cls, _section_values(cls, explicit, sections), flag_of=flag)
    return _read_only(derive(MetaseqConfig(**sections, arch=arch)))


def _typed(classes: Dict[str, type], explicit: Dict[str, Any]) -> Dict[str, Any]:
    """`explicit` with the command line's strings as their fields' types, for the architecture's
    function: fairseq's computed with argparse's typed values (`args.decoder_embed_dim * 4`)."""
    owners = {f.name: cls for cls in reversed(list(classes.values())) for f in dataclasses.fields(cls)}
    return {name: validate_value(owners[name], name, value_from_text(value, field_types(owners[name])[name]), flag(name))
            if name in owners else value for name, value in explicit.items()}


def config_from_values(values: Mapping[str, Any], arch: str = "transformer_lm") -> MetaseqConfig:
    """The config the flags `values` ({"decoder_layers": 2, ...}) give with the default components
    and no demo run (what `mseq import` records for the model it writes)."""
    return build_config(section_classes({**DEFAULT_COMPONENTS, "arch": arch}), dict(values), arch)


def resolve(cfg: MetaseqConfig, context: RunContext) -> MetaseqConfig:
    """A new read-only config for the run itself: the demo's data directory (DEMO_DATA_DIR), and
    what only the run's context can settle (see `RunContext`)."""
    task = cfg.task
    changes: Dict[str, Any] = {}
    if cfg.dataset.demo:
        changes["data"] = DEMO_DATA_DIR
    factor = context.restored_padding_factor
    if (factor is not None and "padding_factor" in task.__dataclass_fields__
            and task.final_vocab_size is None and factor % task.padding_factor == 0):
        changes["padding_factor"] = factor
    if not changes:
        return cfg
    return _read_only(dataclasses.replace(cfg, task=dataclasses.replace(task, **changes)))


def _read_only(cfg: MetaseqConfig) -> MetaseqConfig:
    """Make the config and every section of metaseq_ds's own components read-only (plugin
    configs are left assignable: fairseq-style code sets fields of its own config)."""
    registries = component_registries()
    for name in FIXED_SECTIONS + COMPONENT_SECTIONS:
        section = getattr(cfg, name)
        if name in COMPONENT_SECTIONS:
            entry = registries[name].get(section._name)
            if not entry.cls.__module__.startswith("metaseq_ds."):
                continue
        make_read_only(section)
    make_read_only(cfg)
    return cfg


def _section_values(cls: type, explicit: Dict[str, Any], resolved: Dict[str, Any]) -> Dict[str, Any]:
    values = {}
    types = field_types(cls)
    for f in dataclasses.fields(cls):
        if f.name in explicit:
            values[f.name] = value_from_text(explicit[f.name], types[f.name])
        else:  # a shared field takes the resolved value of the fixed section that owns the name
            for section in FIXED_SECTIONS:
                if section in resolved and f.name in resolved[section].__dataclass_fields__:
                    values[f.name] = getattr(resolved[section], f.name)
                    break
    return values


def _add_field_argument(group, f: dataclasses.Field, cls: type) -> None:
    """An option that keeps the command line's text (checked with the other values in `build_config`)."""
    if f.name == "data" and cls.__name__ != "DatasetConfig":
        group.add_argument("data", nargs="?", help=f.metadata.get("help", ""))
        return
    help_text = field_help(cls, f)
    if plain_type(field_types(cls)[f.name]) is bool:
        group.add_argument(*option_names(f.name), action="store_true", help=help_text)
        return
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    )
    group.add_argument(*option_names(f.name), metavar=f.name.upper(), help=f"{help_text} [default: {default}]")


def derive(cfg: MetaseqConfig) -> MetaseqConfig:
    """A new config with the values computed from other sections, and metaseq's flags mapped to
    DeepSpeed meanings (part of validation: `build_config` calls it before the config is read-only)."""
    model, task, common, dist = cfg.model, cfg.task, cfg.common, cfg.distributed_training
    changes: Dict[str, Dict[str, Any]] = {name: {} for name in FIXED_SECTIONS + COMPONENT_SECTIONS}
    if "max_target_positions" in model.__dataclass_fields__ and model.max_target_positions is None:
        changes["model"]["max_target_positions"] = task.tokens_per_sample
    if "total_num_update" in cfg.lr_scheduler.__dataclass_fields__ and cfg.lr_scheduler.total_num_update is None:
        if cfg.optimization.max_update < 1:
            raise UsageError(f"--lr-scheduler {cfg.lr_scheduler._name} decays over --total-num-update updates: "
                             "give it, or --max-update")
        changes["lr_scheduler"]["total_num_update"] = cfg.optimization.max_update
    fp16, bf16 = common.fp16 or common.memory_efficient_fp16, common.bf16 or common.memory_efficient_bf16
    if fp16 and bf16:
        raise UsageError("--fp16 and --bf16 exclude each other: choose one")
    changes["common"].update(fp16=fp16, bf16=bf16)
    if dist.ddp_backend == "fully_sharded" and dist.zero_stage is None:
        changes["distributed_training"]["zero_stage"] = 3
    _derive_tensor_parallel(cfg, changes)
    return dataclasses.replace(cfg, **{
        name: dataclasses.replace(getattr(cfg, name), **values) for name, values in changes.items() if values})


def _derive_tensor_parallel(cfg: MetaseqConfig, changes: Dict[str, Dict[str, Any]]) -> None:
    """One tensor-parallel degree from metaseq's and DeepSpeed's flag; checks that need no ranks."""
    from metaseq_ds.distributed.tensor_parallel import check_divisible

    dist = cfg.distributed_training
    sizes = {dist.model_parallel_size, dist.tensor_parallel_size} - {1}
    if len(sizes) > 1:
        raise UsageError(f"--model-parallel-size {dist.model_parallel_size} and --tensor-parallel-size "
                         f"{dist.tensor_parallel_size} disagree: give one of them")
    size = max(sizes, default=1)
    changes["distributed_training"].update(model_parallel_size=size, tensor_parallel_size=size)
    if size == 1:
        return
    check_divisible(cfg.model, size)
    task = cfg.task
    if "padding_factor" in task.__dataclass_fields__:
        # metaseq's rule: the vocabulary is a multiple of 8*N
        changes["task"]["padding_factor"] = math.lcm(task.padding_factor, 8 * size)
        if task.final_vocab_size is not None and task.final_vocab_size % size != 0:
            raise UsageError(f"--final-vocab-size {task.final_vocab_size} is not divisible by "
                             f"--model-parallel-size {size} (the vocabulary is split across ranks)")


def config_from_dict(values: Dict[str, Any], overrides: Optional[Mapping[str, Mapping[str, Any]]] = None) -> MetaseqConfig:
    """Rebuild a config saved by `MetaseqConfig.to_dict` (checkpoints store it), read-only;
    `overrides` ({section: {field: value}}) replace saved values before validation."""
    registries = component_registries()
    classes: Dict[str, type] = {
        name: MetaseqConfig.__dataclass_fields__[name].default_factory for name in FIXED_SECTIONS
    }
    for section in COMPONENT_SECTIONS:
        classes[section] = registries[section].get(values[section]["_name"]).dataclass
    sections = {}
    for name, cls in classes.items():
        saved = {k: v for k, v in values.get(name, {}).items() if k != "_name"}
        saved.update((overrides or {}).get(name, {}))
        sections[name] = validate_config(cls, saved, flag_of=flag)
    return _read_only(MetaseqConfig(**sections, arch=values.get("arch")))


def load_config_file(path: Path) -> Dict[str, Any]:
    """A YAML/JSON file of flag values, flat or nested by section; keys use _ or -."""
    if not path.is_file():
        raise UsageError(f"--config: {path} is not a file")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else _yaml_load(text)
    except (ValueError, OSError) as error:
        raise UsageError(f"--config: cannot read {path}: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config: {path} must hold a mapping of flag names to values")
    flat: Dict[str, Any] = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        if key in FIXED_SECTIONS + COMPONENT_SECTIONS and isinstance(value, dict):
            if "_name" in value and key != "model":  # a model section names the model, not the arch
                flat[key] = value["_name"]
            flat.update({k.replace("-", "_"): v for k, v in value.items() if k != "_name"})
        else:
            flat[key] = value
    return flat


def _yaml_load(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(str(error)) from None


# ---- fairseq's and metaseq's parser functions, for users' scripts ------------------------------
#
#     parser = options.get_training_parser()
#     parser.add_argument("--my-option")
#     args = options.parse_args_and_arch(parser)  # args.lr, args.decoder_layers (the arch's), args.my_option
#
# `mseq train` does not use them: it parses into a validated MetaseqConfig (`parse_train_config`).

CHOOSERS = ("task", "criterion", "optimizer", "lr_scheduler")  # get_parser's; get_training_parser adds --arch


def get_parser(desc: str, default_task: str = DEFAULT_COMPONENTS["task"]) -> argparse.ArgumentParser:
    """The common options and the component choosers (`--task`, `--criterion`, `--optimizer`,
    `--lr-scheduler`); `parse_args_and_arch` adds the chosen components' options."""
    parser = argparse.ArgumentParser(description=desc, allow_abbrev=False)
    _add_sections(parser, ["common"])
    defaults = {**DEFAULT_COMPONENTS, "task": default_task}
    for name in CHOOSERS:
        parser.add_argument(flag(name), metavar=name.upper(), default=defaults[name], help=f"default {defaults[name]}")
    return parser


def get_training_parser(default_task: str = DEFAULT_COMPONENTS["task"]) -> argparse.ArgumentParser:
    """`get_parser` with the dataset, distributed training, model (`--arch`), optimization and
    checkpoint options."""
    parser = get_parser("Trainer", default_task)
    _add_sections(parser, ["dataset", "distributed_training"])
    parser.add_argument_group("model").add_argument(
        "--arch", "-a", metavar="ARCH", default=DEFAULT_COMPONENTS["arch"], help=f"default {DEFAULT_COMPONENTS['arch']}")
    _add_sections(parser, ["optimization", "checkpoint"])
    return parser


def get_generation_parser(default_task: str = DEFAULT_COMPONENTS["task"], interactive: bool = False) -> argparse.ArgumentParser:
    """`get_parser` with the dataset, distributed training, generation (metaseq's flags, which
    `task.build_generator` reads) and checkpoint options; `interactive` adds `--buffer-size` and
    `--input`. The model comes from the checkpoint: there is no `--arch`."""
    from metaseq_ds.dataclass.configs import GenerationConfig, InteractiveConfig

    parser = get_parser("Generation", default_task)
    _add_sections(parser, ["dataset", "distributed_training"])
    gen_parser_from_dataclass(parser.add_argument_group("generation"), GenerationConfig())
    _add_sections(parser, ["checkpoint"])
    if interactive:
        gen_parser_from_dataclass(parser.add_argument_group("interactive"), InteractiveConfig())
    return parser


def _add_sections(parser: argparse.ArgumentParser, names: Sequence[str]) -> None:
    for name in names:
        gen_parser_from_dataclass(parser.add_argument_group(name), MetaseqConfig.__dataclass_fields__[name].default_factory())


def parse_args_and_arch(parser: argparse.ArgumentParser, input_args: Optional[Sequence[str]] = None,
                        parse_known: bool = False, suppress_defaults: bool = False,
                        modify_parser: Optional[Callable[[argparse.ArgumentParser], None]] = None):
    """metaseq's two passes: find the chosen components (importing `--user-dir` first), add their
    options to `parser`, parse again, then let `--arch` fill the model options not given (those it
    leaves take the model config's defaults).

    Returns an argparse namespace, each value parsed and checked by its field's type and range;
    with `parse_known`, also the arguments not understood. `suppress_defaults`: only the values
    the command line gives. `modify_parser(parser)` runs before each pass (to change defaults).
    `input_args` defaults to the command line.
    """
    argv = _negative_values_attached(sys.argv[1:] if input_args is None else input_args)
    if suppress_defaults:
        full, _ = parse_args_and_arch(parser, argv, parse_known=True, modify_parser=modify_parser)
        unset = argparse.Namespace(**{name: None for name in vars(full)})  # what stays None was not given
        given, extra = parser.parse_known_args(argv, unset) if parse_known else (parser.parse_args(argv, unset), None)
        args = argparse.Namespace(**{name: value for name, value in vars(given).items() if value is not None})
        return (args, extra) if parse_known else args
    user_dir = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    user_dir.add_argument("--user-dir")
    import_plugins(user_dir.parse_known_args(argv)[0].user_dir)
    if modify_parser is not None:
        modify_parser(parser)
    known, _ = parser.parse_known_args(argv)
    chosen = {name: vars(known)[name] for name in DEFAULT_COMPONENTS if name in vars(known)}
    model_config = _add_component_options(parser, chosen)
    if modify_parser is not None:
        modify_parser(parser)
    args, extra = parser.parse_known_args(argv) if parse_known else (parser.parse_args(argv), None)
    if "arch" in chosen:
        _apply_arch(args, model_config)
    return (args, extra) if parse_known else args


def _add_component_options(parser: argparse.ArgumentParser, chosen: Mapping[str, str]) -> Optional[type]:
    """Add the options of the components in `chosen` (by chooser name); the model's config class.

    A component class with an `add_args` (fairseq-style; `BaseTask`'s adds its config's) adds its
    own. The model's options have no defaults here, so that the arch can fill those not given."""
    registries = component_registries()
    model_config = None
    if "arch" in chosen:
        model = registries["model"].get(model_of_arch(chosen["arch"]))
        model_config = model.dataclass
        group = parser.add_argument_group("model-specific configuration", argument_default=argparse.SUPPRESS)
        _add_component(group, model, delete_default=True)
    for name in CHOOSERS:
        if name in chosen:
            _add_component(parser, registries[name].get(chosen[name]), delete_default=False)
    return model_config


def _add_component(parser, entry, delete_default: bool) -> None:
    if hasattr(entry.cls, "add_args"):
        entry.cls.add_args(parser)
    elif entry.dataclass is not None:
        gen_parser_from_dataclass(parser, entry.dataclass(), delete_default=delete_default)


def _apply_arch(args: argparse.Namespace, model_config: Optional[type]) -> None:
    """The arch's defaults for the model options not given, then the model config's for the rest."""
    from metaseq_ds import models

    vars(args).update(models.arch_defaults(args.arch, vars(args)))
    if model_config is not None:
        defaults = model_config()
        for f in dataclasses.fields(defaults):
            vars(args).setdefault(f.name, getattr(defaults, f.name))
