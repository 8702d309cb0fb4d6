"""fairseq's and metaseq's parser functions for users' scripts: `gen_parser_from_dataclass`,
`get_training_parser` / `get_generation_parser`, and `parse_args_and_arch`'s two passes."""

import argparse
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Tuple

import pytest

from metaseq_ds import models
from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.dataclass.constraints import PositiveInt
from metaseq_ds.dataclass.utils import gen_parser_from_dataclass
from metaseq_ds.errors import UsageError
from metaseq_ds.options import get_generation_parser, get_training_parser, parse_args_and_arch
from metaseq_ds.renames import new_module_path
from metaseq_ds.tasks import TASK_REGISTRY, BaseTask, register_task

ARCH = "transformer_lm_gpt2_tiny"
PLUGIN = Path(__file__).parent / "plugins" / "stateful_task_plugin"


@dataclass
class DepthConfig(MetaseqDataclass):
    depth: PositiveInt = field(default=2, metadata={"help": "layers"})


@dataclass
class PluginConfig(MetaseqDataclass):
    its_size: PositiveInt = field(default=3, metadata={"help": "how many"})
    its_scale: Optional[float] = field(default=None, metadata={"help": "a scale"})
    its_mode: Literal["fast", "slow"] = field(default="fast", metadata={"help": "how"})
    its_betas: Tuple[float, float] = field(default=(0.9, 0.98), metadata={"help": "two betas"})
    keep_going: bool = field(default=True, metadata={"help": "do not stop"})
    inner: DepthConfig = field(default_factory=DepthConfig)


def test_gen_parser_from_dataclass_adds_typed_checked_options_for_a_plugin_config(capsys):
    parser = argparse.ArgumentParser()
    gen_parser_from_dataclass(parser, PluginConfig(its_size=4))
    defaults = vars(parser.parse_args([]))
    assert defaults == {"its_size": 4, "its_scale": None, "its_mode": "fast", "its_betas": (0.9, 0.98),
                        "keep_going": True, "depth": 2}
    args = parser.parse_args(["--its-size", "5", "--its-scale", "0.5", "--its-mode", "slow", "--its-betas", "(0.8, 0.9)",
                              "--keep-going", "--depth", "4"])
    assert (args.its_size, args.its_scale, args.its_mode, args.its_betas, args.keep_going, args.depth) == (
        5, 0.5, "slow", (0.8, 0.9), False, 4)  # a bool that defaults to True is switched off, as in fairseq
    help_text = " ".join(parser.format_help().split())
    assert "how many; must be >= 1" in help_text and "how (one of: fast, slow)" in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["--its-size", "0"])
    assert "argument --its-size: --its-size must be >= 1, got 0" in capsys.readouterr().err


def test_gen_parser_from_dataclass_prefixes_and_deletes_defaults():
    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    gen_parser_from_dataclass(parser, PluginConfig(), delete_default=True, with_prefix="--encoder")
    assert vars(parser.parse_args([])) == {}
    args = parser.parse_args(["--encoder-its-size", "6", "--encoder-inner-depth", "3"])
    assert vars(args) == {"encoder_its_size": 6, "encoder_inner_depth": 3}
    assert "encoder: how many" in parser.format_help()


def test_training_parser_gives_the_flags_the_archs_defaults_and_the_components_options():
    parser = get_training_parser()
    parser.add_argument("--my-option", default="mine")  # a script's own option
    args = parse_args_and_arch(parser, ["DATA", "--arch", ARCH, "--lr", "0.1", "--decoder-layers", "3",
                                        "--adam-betas", "(0.9, 0.95)", "--stop-min-lr", "-1e-3", "--warmup-updates", "7"])
    arch = models.arch_defaults(ARCH, {})
    assert args.data == "DATA" and args.lr == 0.1 and args.stop_min_lr == -1e-3 and args.my_option == "mine"
    assert args.decoder_layers == 3 != arch["decoder_layers"]  # given wins over the arch
    assert args.decoder_embed_dim == arch["decoder_embed_dim"] and args.activation_fn == arch["activation_fn"]
    assert args.share_decoder_input_output_embed is False  # neither given nor the arch's: the model config's
    assert (args.task, args.criterion, args.optimizer, args.lr_scheduler) == (
        "streaming_language_modeling", "cross_entropy", "adam", "inverse_sqrt")
    assert args.tokens_per_sample == 1024 and args.adam_betas == (0.9, 0.95) and args.warmup_updates == 7
    assert args.max_update == 0 and args.save_dir == "checkpoints"  # the fixed sections' defaults


def test_parse_known_suppress_defaults_and_modify_parser():
    args, extra = parse_args_and_arch(get_training_parser(), ["DATA", "--arch", ARCH, "--no-such-flag"], parse_known=True)
    assert extra == ["--no-such-flag"] and args.arch == ARCH and args.data == "DATA"
    given = parse_args_and_arch(get_training_parser(), ["--arch", ARCH, "--lr", "0.5"], suppress_defaults=True)
    assert vars(given) == {"arch": ARCH, "lr": 0.5}
    changed = parse_args_and_arch(get_training_parser(), [], modify_parser=lambda p: p.set_defaults(max_update=9))
    assert changed.max_update == 9 and changed.arch == "transformer_lm_gpt2_tiny"
    with pytest.raises(UsageError, match="--arch: unknown architecture 'transformer_lm_gpt2_tiyn'; did you mean"):
        parse_args_and_arch(get_training_parser(), ["--arch", "transformer_lm_gpt2_tiyn"])


@pytest.fixture
def plugin_registry(monkeypatch):
    """Tasks registered by a test, and its --user-dir plugin, are gone after it."""
    monkeypatch.setattr(TASK_REGISTRY, "entries", dict(TASK_REGISTRY.entries))
    yield
    sys.modules.pop(PLUGIN.name, None)


def test_plugin_tasks_options_come_from_their_config(plugin_registry):
    @register_task("test_sized_task", dataclass=PluginConfig)
    class SizedTask(BaseTask):
        pass

    args = parse_args_and_arch(get_training_parser(), ["--task", "test_sized_task", "--its-size", "8", "--depth", "5"])
    assert (args.its_size, args.depth, args.its_mode) == (8, 5, "fast")
    # a --user-dir plugin registers before its task is looked up
    args = parse_args_and_arch(get_training_parser(), ["--user-dir", str(PLUGIN), "--task", "token_counting_lm"])
    assert args.task == "token_counting_lm" and args.tokens_per_sample == 1024


def test_generation_parser_has_metaseqs_generation_flags_and_no_arch():
    args = parse_args_and_arch(get_generation_parser(interactive=True),
                               ["--path", "ckpt", "--beam", "2", "--sampling", "--sampling-topp", "0.9", "--buffer-size", "4"])
    assert (args.path, args.beam, args.sampling, args.sampling_topp, args.max_len_b) == ("ckpt", 2, True, 0.9, 200)
    assert (args.buffer_size, args.input) == (4, "-") and not hasattr(args, "arch")
    assert not hasattr(parse_args_and_arch(get_generation_parser(), []), "buffer_size")


@pytest.mark.parametrize("old, names", [
    ("fairseq.options", ["get_training_parser", "get_generation_parser", "get_parser", "parse_args_and_arch",
                         "gen_parser_from_dataclass"]),
    ("metaseq.options", ["get_training_parser", "parse_args_and_arch", "gen_parser_from_dataclass"]),
    ("metaseq.dataclass.utils", ["gen_parser_from_dataclass"]),
    ("metaseq.tasks.base_task", ["StatefulContainer", "BaseTask"]),
])
def test_old_module_paths_resolve(old, names):
    module = importlib.import_module(new_module_path(old)[0])
    assert all(hasattr(module, name) for name in names)
