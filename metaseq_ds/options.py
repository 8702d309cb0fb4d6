"""From command line and config file to a validated `MetaseqConfig`.

Precedence: command line > `--config FILE` > the architecture's defaults > field defaults.
Flags are derived from the dataclass fields of the fixed sections and of the chosen
components (`--task`, `--arch`, `--criterion`, `--optimizer`, `--lr-scheduler`), so plugin
configs get flags for free. A component field named like a fixed-section field (`lr`,
`max_update`, `batch_size`, `seed`) receives that same value: metaseq expressed this with
`II("optimization.lr")` interpolation; here it is one rule in `_section_values`.
"""

import argparse
import ast
import dataclasses
import importlib.util
import json
import math
import os
import sys
import typing
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from metaseq_ds.dataclass import COMPONENT_SECTIONS, FIXED_SECTIONS, MetaseqConfig, validate_config
from metaseq_ds.errors import UsageError
from metaseq_ds.registry import Registry, closest

DEFAULT_COMPONENTS = {
    "task": "streaming_language_modeling",
    "arch": "transformer_lm_gpt2_tiny",
    "criterion": "cross_entropy",
    "optimizer": "adam",
    "lr_scheduler": "inverse_sqrt",
}

# `mseq train` with no data trains this on the embedded demo corpus; explicit values still win.
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
    "num_workers": "data is read in the training process; --num-workers has no effect",
    "data_buffer_size": "--data-buffer-size has no effect here",
    "memory_efficient_fp16": "--memory-efficient-fp16 means --fp16 here (DeepSpeed keeps fp32 master weights)",
    "memory_efficient_bf16": "--memory-efficient-bf16 means --bf16 here",
    "distributed_world_size": "the launcher sets the world size; --distributed-world-size is only checked",
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def component_registries() -> Dict[str, Registry]:
    """The registries, imported here because they pull in torch (not on the `--help` path)."""
    from metaseq_ds import criterions, model_parallel, models, optim, tasks  # noqa: F401 (model_parallel registers)
    from metaseq_ds.optim import lr_scheduler

    return {
        "task": tasks.TASK_REGISTRY,
        "model": models.MODEL_REGISTRY,
        "criterion": criterions.CRITERION_REGISTRY,
        "optimizer": optim.OPTIMIZER_REGISTRY,
        "lr_scheduler": lr_scheduler.LR_SCHEDULER_REGISTRY,
    }


def parse_train_config(argv: Sequence[str]) -> MetaseqConfig:
    return TrainArgumentParser(argv).config()


class TrainArgumentParser:
    """Two passes, as fairseq's: find the components (and plugins), then parse their flags."""

    def __init__(self, argv: Sequence[str]):
        self.argv = list(argv)
        pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        pre.add_argument("--config")
        pre.add_argument("--user-dir")
        for name in DEFAULT_COMPONENTS:
            pre.add_argument(flag(name), *(["-a"] if name == "arch" else []))
        known, _ = pre.parse_known_args(self.argv)
        self.config_file = known.config
        self.file_values = load_config_file(Path(known.config)) if known.config else {}
        user_dir = known.user_dir or self.file_values.get("user_dir")
        if user_dir:
            if os.environ.get("METASEQ_DS_COMPAT"):  # plugins that `import fairseq`, under any launcher
                import compat

                compat.install_from_env()
            import_user_module(user_dir)
        self.registries = component_registries()
        from metaseq_ds import models

        self.models = models
        self.choice = {
            name: getattr(known, name) or self.file_values.get(name) or default
            for name, default in DEFAULT_COMPONENTS.items()
        }
        arch = self.choice["arch"]
        if arch not in models.ARCH_MODEL_REGISTRY:
            raise UsageError(
                f"--arch: unknown architecture {arch!r}{closest(arch, models.ARCH_MODEL_REGISTRY)} "
                f"(choose from {', '.join(sorted(models.ARCH_MODEL_REGISTRY))})"
            )
        self.model_name = models.ARCH_MODEL_REGISTRY[arch]
        self.section_classes = {name: MetaseqConfig.__dataclass_fields__[name].default_factory for name in FIXED_SECTIONS}
        for section in COMPONENT_SECTIONS:
            key = self.model_name if section == "model" else self.choice[section]
            entry = self.registries[section].get(key)
            if entry.dataclass is None:
                raise UsageError(f"{self.registries[section].flag} {key!r} has no config dataclass")
            self.section_classes[section] = entry.dataclass
        self.parser, self.owner = self._build_parser()

    def _build_parser(self) -> Tuple[argparse.ArgumentParser, Dict[str, str]]:
        parser = argparse.ArgumentParser(
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
        explicit = {**self.file_values, **cli_values}
        if explicit.get("data") is None:
            arch_given = "arch" in self.file_values or any(a in ("-a", "--arch") or a.startswith("--arch=") for a in self.argv)
            explicit = {**DEMO_DEFAULTS, **({} if arch_given else DEMO_MODEL_DEFAULTS), **explicit}
        for name, reason in METASEQ_ONLY_FLAGS.items():
            if explicit.get(name):
                warnings.warn(reason, stacklevel=2)
        explicit.update(self.models.arch_defaults(self.choice["arch"], explicit))
        return _build_config(self.section_classes, explicit, arch=self.choice["arch"])

    def format_help(self) -> str:
        return self.parser.format_help()


def _build_config(section_classes: Dict[str, type], explicit: Dict[str, Any], arch: Optional[str]) -> MetaseqConfig:
    sections: Dict[str, Any] = {}
    for name in FIXED_SECTIONS + COMPONENT_SECTIONS:
        cls = section_classes[name]
        sections[name] = validate_config(cls, _section_values(cls, explicit, sections), flag_of=flag)
    return derive(MetaseqConfig(**sections, arch=arch))


def _section_values(cls: type, explicit: Dict[str, Any], resolved: Dict[str, Any]) -> Dict[str, Any]:
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in explicit:
            values[f.name] = _from_text(explicit[f.name], f.type, f.name)
        else:  # a shared field takes the resolved value of the fixed section that owns the name
            for section in FIXED_SECTIONS:
                if section in resolved and f.name in resolved[section].__dataclass_fields__:
                    values[f.name] = getattr(resolved[section], f.name)
                    break
    return values


def _from_text(value: Any, annotation: Any, name: str) -> Any:
    """Command-line strings for tuples/lists/None become Python values; pydantic does the rest."""
    if not isinstance(value, str):
        return value
    base = _strip_optional(annotation)
    if value in ("None", "none") and base is not annotation:
        return None
    if typing.get_origin(base) in (tuple, list, typing.Tuple, typing.List) or base in (tuple, list):
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed = [part.strip() for part in value.split(",")]
        return list(parsed) if isinstance(parsed, (tuple, list)) else [parsed]
    return value


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _add_field_argument(group, f: dataclasses.Field, cls: type) -> None:
    names = [flag(f.name)]
    if f.name == "local_rank":  # the deepspeed launcher passes --local_rank=N
        names.append("--local_rank")
    if f.name == "data" and cls.__name__ != "DatasetConfig":
        group.add_argument("data", nargs="?", help=f.metadata.get("help", ""))
        return
    help_text = f.metadata.get("help", "")
    annotation = _strip_optional(f.type) if not isinstance(f.type, str) else f.type
    if annotation is bool:
        group.add_argument(*names, action="store_true", help=help_text)
        return
    default = f.default if f.default is not dataclasses.MISSING else (
        f.default_factory() if f.default_factory is not dataclasses.MISSING else None
    )
    choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
    if choices:
        help_text += f" (one of: {', '.join(map(str, choices))})"
    elif isinstance(annotation, type) and issubclass(annotation, __import__("enum").Enum):
        help_text += f" (one of: {', '.join(str(m.value) for m in annotation)})"
    group.add_argument(*names, metavar=f.name.upper(), help=f"{help_text} [default: {default}]")


def derive(cfg: MetaseqConfig) -> MetaseqConfig:
    """Values computed from other sections, and metaseq's flags mapped to DeepSpeed meanings."""
    model, task, common, dist = cfg.model, cfg.task, cfg.common, cfg.distributed_training
    if "max_target_positions" in model.__dataclass_fields__ and model.max_target_positions is None:
        model.max_target_positions = task.tokens_per_sample
    if "total_num_update" in cfg.lr_scheduler.__dataclass_fields__ and cfg.lr_scheduler.total_num_update is None:
        cfg.lr_scheduler.total_num_update = cfg.optimization.max_update
    common.fp16 = common.fp16 or common.memory_efficient_fp16
    common.bf16 = common.bf16 or common.memory_efficient_bf16
    if common.fp16 and common.bf16:
        raise UsageError("--fp16 and --bf16 exclude each other: choose one")
    if dist.ddp_backend == "fully_sharded" and dist.zero_stage is None:
        dist.zero_stage = 3
    if dist.zero_stage is not None and dist.zero_stage not in (0, 1, 2, 3):
        raise UsageError(f"invalid value {dist.zero_stage} for --zero-stage: choose 0, 1, 2 or 3")
    _derive_tensor_parallel(cfg)
    return cfg


def _derive_tensor_parallel(cfg: MetaseqConfig) -> None:
    """One tensor-parallel degree from metaseq's and DeepSpeed's flag; checks that need no ranks."""
    from metaseq_ds.distributed.tensor_parallel import check_divisible

    dist = cfg.distributed_training
    sizes = {dist.model_parallel_size, dist.tensor_parallel_size} - {1}
    if len(sizes) > 1:
        raise UsageError(f"--model-parallel-size {dist.model_parallel_size} and --tensor-parallel-size "
                         f"{dist.tensor_parallel_size} disagree: give one of them")
    size = max(sizes, default=1)
    if size < 1 or min(dist.model_parallel_size, dist.tensor_parallel_size) < 1:
        raise UsageError("--model-parallel-size must be at least 1")
    dist.model_parallel_size = dist.tensor_parallel_size = size
    if size == 1:
        return
    check_divisible(cfg.model, size)
    task = cfg.task
    if "padding_factor" in task.__dataclass_fields__:
        task.padding_factor = math.lcm(task.padding_factor, 8 * size)  # metaseq: vocab a multiple of 8*N
        if task.final_vocab_size is not None and task.final_vocab_size % size != 0:
            raise UsageError(f"--final-vocab-size {task.final_vocab_size} is not divisible by "
                             f"--model-parallel-size {size} (the vocabulary is split across ranks)")


def config_from_dict(values: Dict[str, Any]) -> MetaseqConfig:
    """Rebuild a config saved by `MetaseqConfig.to_dict` (checkpoints store it)."""
    registries = component_registries()
    section_classes: Dict[str, type] = {
        name: MetaseqConfig.__dataclass_fields__[name].default_factory for name in FIXED_SECTIONS
    }
    for section in COMPONENT_SECTIONS:
        section_classes[section] = registries[section].get(values[section]["_name"]).dataclass
    sections = {}
    for name, cls in section_classes.items():
        saved = {k: v for k, v in values.get(name, {}).items() if k != "_name"}
        sections[name] = validate_config(cls, saved, flag_of=flag)
    return MetaseqConfig(**sections, arch=values.get("arch"))


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


def import_user_module(user_dir: str) -> None:
    """Import a plugin package by path, explicitly (no sys.path edits, no scanning)."""
    path = Path(user_dir).resolve()
    init = path / "__init__.py" if path.is_dir() else path
    if not init.is_file():
        raise UsageError(f"--user-dir: {user_dir} is neither a package directory nor a .py file")
    name = path.stem
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(path)] if path.is_dir() else None
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
