"""Config parsing: flags from dataclasses, precedence, plugin configs, and clear errors."""

import json
from dataclasses import dataclass, field

import pytest

from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.distributed.deepspeed_config import build_deepspeed_config
from metaseq_ds.errors import UsageError
from metaseq_ds.options import TrainArgumentParser, config_from_dict, parse_train_config
from metaseq_ds.private_apis import torch_ops

DATA = ["/some/data"]


def test_metaseq_flags_reach_their_sections():
    cfg = parse_train_config(DATA + [
        "--arch", "transformer_lm_gpt2_tiny", "--lr", "0.0005", "--max-update", "7", "--batch-size", "4",
        "--update-freq", "2", "--tokens-per-sample", "64", "--adam-betas", "(0.9, 0.95)", "--weight-decay", "0.1",
        "--clip-norm", "1.0", "--lr-scheduler", "polynomial_decay", "--warmup-updates", "3", "--save-dir", "x",
        "--save-interval-updates", "5", "--validate-interval-updates", "5", "--seed", "3", "--bf16",
        "--log-format", "json", "--log-interval", "1", "--share-decoder-input-output-embed", "--dropout", "0.2",
    ])
    assert cfg.task.data == "/some/data"
    assert cfg.optimization.lr == 0.0005 and cfg.optimizer.lr == 0.0005  # shared field
    assert cfg.optimization.max_update == 7 and cfg.lr_scheduler.total_num_update == 7  # derived
    assert cfg.dataset.batch_size == 4 and cfg.optimization.update_freq == 2
    assert cfg.optimizer.adam_betas == (0.9, 0.95) and cfg.optimizer.weight_decay == 0.1
    assert cfg.lr_scheduler._name == "polynomial_decay" and cfg.lr_scheduler.warmup_updates == 3
    assert cfg.common.bf16 and cfg.common.seed == 3 and cfg.common.log_interval == 1
    assert cfg.model.dropout == 0.2 and cfg.model.share_decoder_input_output_embed
    assert cfg.model.max_target_positions == 64  # derived from the task's tokens_per_sample
    assert cfg.model.decoder_embed_dim == 64  # from the arch


def test_precedence_command_line_over_file_over_arch(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("arch: opt_125m\noptimization:\n  lr: 0.001\n  max_update: 9\ndecoder-layers: 3\ndropout: 0.3\n")
    cfg = parse_train_config(DATA + ["--config", str(config), "--lr", "0.002"])
    assert cfg.arch == "opt_125m"
    assert cfg.optimization.lr == 0.002  # command line beats file
    assert cfg.optimization.max_update == 9  # file beats default
    assert cfg.model.decoder_layers == 3  # file beats arch
    assert cfg.model.decoder_embed_dim == 768  # arch beats field default
    assert cfg.model.dropout == 0.3


def test_json_config_and_round_trip(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"data": "/d", "batch_size": 3, "optimizer": "adam"}))
    cfg = parse_train_config(["--config", str(config)])
    assert cfg.task.data == "/d" and cfg.dataset.batch_size == 3
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.to_dict() == cfg.to_dict()


def test_plugin_config_written_the_fairseq_way_gets_flags():
    from metaseq_ds.criterions import BaseCriterion, register_criterion

    @dataclass
    class ScaledCrossEntropyConfig(MetaseqDataclass):
        loss_scale: float = field(default=1.0, metadata={"help": "multiply the loss by this"})

    @register_criterion("test_scaled_ce", dataclass=ScaledCrossEntropyConfig)
    class ScaledCrossEntropy(BaseCriterion):
        def __init__(self, task, loss_scale):
            super().__init__(task)
            self.loss_scale = loss_scale

    parser = TrainArgumentParser(DATA + ["--criterion", "test_scaled_ce", "--loss-scale", "2.5"])
    assert "multiply the loss by this" in parser.format_help()
    cfg = parser.config()
    assert cfg.criterion.loss_scale == 2.5


def test_every_builtin_field_has_help():
    parser = TrainArgumentParser(DATA)
    for action in parser.parser._actions:
        if action.dest not in ("help",):
            assert action.help and not action.help.startswith(" ["), action.dest


@pytest.mark.parametrize("argv, message", [
    (["--lrr", "0.1"], "unknown flag --lrr; did you mean '--lr'?"),
    (["--max-update", "ten"], "invalid value 'ten' for --max-update"),
    (["--lr", "-1e-3"], "--lr must be > 0, got -1e-3"),  # argparse alone takes '-1e-3' for a flag
    (["--max-update"], "argument --max-update: expected one argument"),
    # The schedulers' own relations, checked at parse time (they used to wait for the model to be built).
    (["--lr-scheduler", "polynomial_decay"], "--lr-scheduler polynomial_decay decays over --total-num-update"),
    (["--lr-scheduler", "cosine"], "cosine needs --lr-period-updates > 0 or --max-update > --warmup-updates"),
    (["--lr-scheduler", "cosine", "--max-update", "9", "--min-lr", "1"], "cosine needs --lr (=0.25) more than --min-lr"),
    (["--sample-break-mode", "paragraph"], "--sample-break-mode"),
    (["--arch", "opt_125"], "--arch: unknown architecture 'opt_125'"),
    (["--optimizer", "adamw"], "--optimizer: unknown optimizer 'adamw'"),
    (["--fp16", "--bf16"], "--fp16 and --bf16"),
    (["--arch", "transformer_lm_gpt2_tiny", "--model-parallel-size", "2"],
     "--model-parallel-size 2 does not divide --decoder-attention-heads 1 (each rank holds whole heads)"),
    (["--decoder-attention-heads", "4", "--decoder-ffn-embed-dim", "1030", "--model-parallel-size", "4"],
     "does not divide --decoder-ffn-embed-dim 1030"),
    (["--model-parallel-size", "2", "--tensor-parallel-size", "4"], "disagree: give one of them"),
    (["--decoder-attention-heads", "4", "--model-parallel-size", "2", "--final-vocab-size", "51"],
     "--final-vocab-size 51 is not divisible"),
])
def test_bad_flags_give_one_clear_line(argv, message):
    with pytest.raises(UsageError) as error:
        parse_train_config(DATA + argv)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_tensor_parallel_degree_pads_the_vocabulary_to_a_multiple_of_8n():
    cfg = parse_train_config(DATA + ["--decoder-attention-heads", "4", "--tensor-parallel-size", "4"])
    assert cfg.distributed_training.model_parallel_size == 4 and cfg.task.padding_factor == 32
    assert parse_train_config(DATA).task.padding_factor == 8


def test_bad_config_file_names_file_and_key(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_updates: 3\n")
    with pytest.raises(UsageError, match=r"run.yaml: unknown key 'max_updates'; did you mean 'max_update'"):
        parse_train_config(DATA + ["--config", str(config)])


def test_metaseq_only_flags_are_accepted_with_a_warning():
    with pytest.warns(UserWarning, match="use-sharded-state"):
        cfg = parse_train_config(DATA + ["--use-sharded-state", "--ddp-backend", "fully_sharded", "--num-workers", "4"])
    assert cfg.distributed_training.zero_stage == 3


def test_demo_defaults_apply_only_without_data():
    demo = parse_train_config([])
    assert demo.task.data is None and demo.optimization.max_update > 0 and demo.model.decoder_embed_dim == 128
    assert parse_train_config(["--arch", "opt_125m"]).model.decoder_embed_dim == 768
    assert parse_train_config(DATA).optimization.max_update == 0


def test_deepspeed_config_is_derived_and_presets_override_only_what_they_set(tmp_path):
    cfg = parse_train_config(DATA + ["--batch-size", "4", "--update-freq", "2", "--clip-norm", "0.5", "--bf16"])
    ds = build_deepspeed_config(cfg, world_size=2, fp16_supported=False, overlaps_communication=False)
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 16 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["stage"] == 3 and ds["bf16"]["enabled"]
    assert build_deepspeed_config(cfg, world_size=1, fp16_supported=False, overlaps_communication=False)["zero_optimization"]["stage"] == 0

    cfg = parse_train_config(DATA + ["--batch-size", "4", "--deepspeed-config", "zero2"])
    ds = build_deepspeed_config(cfg, world_size=1, fp16_supported=False, overlaps_communication=False)
    assert ds["zero_optimization"]["stage"] == 2 and ds["zero_optimization"]["overlap_comm"] is True
    assert ds["train_micro_batch_size_per_gpu"] == 4  # "auto" filled from our config

    preset = tmp_path / "ds.json"
    preset.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    cfg = parse_train_config(DATA + ["--batch-size", "4", "--deepspeed-config", str(preset)])
    with pytest.raises(UsageError, match="set --batch-size instead"):
        build_deepspeed_config(cfg, world_size=1, fp16_supported=False, overlaps_communication=False)


@pytest.mark.parametrize("bf16_matmul", [True, False])
def test_fp16_without_support_falls_back_to_bf16_where_the_cpu_multiplies_it(bf16_matmul):
    cfg = parse_train_config(DATA + ["--fp16"])
    with pytest.warns(UserWarning, match="using bf16" if bf16_matmul else "using fp32 .*no bf16 matmul kernels"):
        ds = build_deepspeed_config(cfg, world_size=1, fp16_supported=False, overlaps_communication=False,
                                    bf16_matmul=bf16_matmul)
    assert ds["bf16"]["enabled"] == bf16_matmul and not ds["fp16"]["enabled"]


def test_bf16_on_a_cpu_without_bf16_kernels_warns_and_keeps_bf16():
    cfg = parse_train_config(DATA + ["--bf16"])
    with pytest.warns(UserWarning, match="--bf16: this CPU has no bf16 matmul kernels.*leave out --bf16"):
        ds = build_deepspeed_config(cfg, world_size=1, fp16_supported=False, overlaps_communication=False,
                                    bf16_matmul=False)
    assert ds["bf16"]["enabled"]


def test_zero12_optimizer_groups_hold_about_one_layer_in_order():
    import torch

    from metaseq_ds.distributed.deepspeed_config import optimizer_group_limit, parameter_groups

    cfg = parse_train_config(["/data", "--arch", "transformer_lm_gpt2_tiny", "--zero-stage", "2"])
    limit = optimizer_group_limit(build_deepspeed_config(cfg, 2, fp16_supported=False, overlaps_communication=False), cfg.model)
    assert limit == 12 * cfg.model.decoder_embed_dim ** 2
    params = [torch.empty(n) for n in (5, 3, 2, 9, 1)]
    groups = parameter_groups(params, 8)
    assert [[p.numel() for p in g["params"]] for g in groups] == [[5, 3], [2], [9], [1]]  # 9 > 8 stands alone
    assert parameter_groups(params, 0) is params
    zero3 = parse_train_config(["/data", "--arch", "transformer_lm_gpt2_tiny", "--zero-stage", "3"])
    assert optimizer_group_limit(build_deepspeed_config(zero3, 2, fp16_supported=False, overlaps_communication=False), zero3.model) == 0


def test_deepspeeds_throughput_timer_and_its_device_syncs_are_off(monkeypatch):
    """DeepSpeed's throughput timer synchronizes the device at each forward and step by default;
    the derived config turns it off (our log times updates itself)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.config import get_timers_config
    from deepspeed.utils.timer import ThroughputTimer

    syncs = []
    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, device_index=None: syncs.append(1))

    def syncs_over_steps(config) -> int:
        syncs.clear()
        timer = ThroughputTimer(get_timers_config(config), batch_size=1)
        for _ in range(4):  # as the engine calls it: start at each forward, stop at each step
            timer.start()
            timer.stop(global_step=True, report_speed=False)
        return len(syncs)

    cfg = parse_train_config(DATA + ["--arch", "transformer_lm_gpt2_tiny"])
    ds = build_deepspeed_config(cfg, 1, fp16_supported=True, overlaps_communication=True)
    assert syncs_over_steps({}) > 0  # DeepSpeed's default
    assert syncs_over_steps(ds) == 0


def test_one_zero3_data_parallel_rank_reduces_a_layer_of_gradients_a_bucket():
    """Nothing to communicate on one data-parallel rank: ZeRO-3's buckets hold a layer (as the rank has
    it) instead of d*d, ~12x fewer reductions; with several ranks, or at ZeRO-1/2, d*d."""
    width = 2048

    def bucket(world_size: int, *flags: str) -> int:
        cfg = parse_train_config(DATA + ["--arch", "opt_1_3b", *flags])
        ds = build_deepspeed_config(cfg, world_size, fp16_supported=True, overlaps_communication=True)
        return ds["zero_optimization"]["reduce_bucket_size"]

    assert bucket(1, "--zero-stage", "3") == 12 * width * width
    assert bucket(2, "--zero-stage", "3", "--model-parallel-size", "2") == 12 * width * width // 2
    assert bucket(2, "--zero-stage", "3") == width * width
    assert bucket(4, "--zero-stage", "3", "--model-parallel-size", "2") == width * width
    assert bucket(2, "--zero-stage", "1", "--model-parallel-size", "2") == width * width
    assert bucket(1, "--zero-stage", "2") == width * width
    assert bucket(1, "--deepspeed-config", "zero3") == 12 * width * width  # the preset's stage decides


def test_one_zero3_data_parallel_rank_persists_every_parameter_unless_they_are_offloaded(tmp_path):
    """One data-parallel rank: no module fetch waits on the device (tests/test_zero3_one_rank.py);
    several ranks keep 10 d; parameter offload keeps the offloaded parameters off the device."""
    from metaseq_ds.private_apis.deepspeed_optimizers import one_rank_persistence_threshold

    def threshold(world_size: int, *flags: str) -> int:
        cfg = parse_train_config(DATA + ["--arch", "opt_1_3b", *flags])
        ds = build_deepspeed_config(cfg, world_size, fp16_supported=True, overlaps_communication=True)
        return ds["zero_optimization"].get("stage3_param_persistence_threshold")

    every = one_rank_persistence_threshold()
    assert every >= 175e9  # any parameter of any model
    assert threshold(1, "--zero-stage", "3") == every
    assert threshold(1, "--deepspeed-config", "zero3") == every
    assert threshold(2, "--zero-stage", "3", "--model-parallel-size", "2") == every  # TP alone: one data-parallel rank
    assert threshold(1, "--zero-stage", "3", "--cpu-offload") == every  # the optimizer offloaded, not the parameters
    assert threshold(2, "--zero-stage", "3") == 10 * 2048
    assert threshold(1, "--deepspeed-config", "zero3_offload") == 10 * 2048
    own = tmp_path / "own.json"
    own.write_text('{"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 7}}')
    assert threshold(1, "--deepspeed-config", str(own)) == 7  # a preset's own value wins, as every value of it


def test_zero3_prefetches_the_next_layer_where_communication_overlaps():
    from metaseq_ds.distributed.deepspeed_config import accelerator_traits

    cfg = parse_train_config(DATA + ["--arch", "opt_1_3b", "--model-parallel-size", "2"])
    layer = 12 * 2048 * 2048 // 2  # one layer's tensor-parallel share

    def zero(overlaps: bool):
        return build_deepspeed_config(cfg, 4, fp16_supported=True, overlaps_communication=overlaps)["zero_optimization"]

    # A GPU: the next layer is gathered while this one computes (DeepSpeed prefetches within the live limit).
    assert zero(True)["stage3_prefetch_bucket_size"] == layer and zero(True)["stage3_max_live_parameters"] == 2 * layer
    # A CPU: gloo computes on the same cores; one layer gathered at a time.
    assert zero(False)["stage3_prefetch_bucket_size"] == 0 and zero(False)["stage3_max_live_parameters"] == layer
    traits = accelerator_traits()  # this CPU machine
    assert (traits["fp16_supported"], traits["overlaps_communication"]) == (False, False)
    assert traits["bf16_matmul"] == torch_ops.cpu_has_bf16_matmul()
