"""The DeepSpeed JSON, derived from our config by one function.

`--deepspeed-config` (a file or a preset name from ds_configs/) overrides only what it sets;
its "auto" values are filled from our config. Nothing else decides the DeepSpeed config.
"""

import copy
import importlib.resources
import json
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

from metaseq_ds.dataclass import MetaseqConfig
from metaseq_ds.distributed.tensor_parallel import tensor_parallel_size
from metaseq_ds.errors import UsageError
from metaseq_ds.private_apis.deepspeed_optimizers import one_rank_persistence_threshold
from metaseq_ds.private_apis.torch_ops import cpu_has_bf16_matmul

PRESETS = ("zero1", "zero2", "zero3", "zero3_offload")
# Measured on an AVX2 AMD EPYC (torch 2.13, one thread): bf16 F.linear 8.7 GFLOP/s, torch.mm 1 GFLOP/s, fp32 65-78.
SLOW_BF16 = "this CPU has no bf16 matmul kernels (on AVX2, PyTorch multiplies bf16 8-60x slower than fp32)"


def load_preset(name_or_path: str) -> Dict[str, Any]:
    if name_or_path in PRESETS:
        text = importlib.resources.files("metaseq_ds.ds_configs").joinpath(f"{name_or_path}.json").read_text()
        return json.loads(text)
    path = Path(name_or_path)
    if not path.is_file():
        raise UsageError(f"--deepspeed-config: {name_or_path} is neither a file nor a preset ({', '.join(PRESETS)})")
    try:
        preset = json.loads(path.read_text())
    except ValueError as error:
        raise UsageError(f"--deepspeed-config: {path} is not valid JSON ({error})") from None
    for owned in ("optimizer", "scheduler"):
        if owned in preset:
            raise UsageError(
                f"--deepspeed-config: {path} sets {owned!r}; metaseq_ds builds it from "
                f"--{'optimizer' if owned == 'optimizer' else 'lr-scheduler'}: remove that section"
            )
    return preset


def resolve_zero_stage(cfg: MetaseqConfig, world_size: int, preset: Optional[Dict[str, Any]] = None) -> int:
    """The ZeRO stage that runs: a --deepspeed-config preset's explicit one (`preset`, if already
    loaded), else --zero-stage, else 3 for several ranks and 0 for one."""
    if preset is None and cfg.distributed_training.deepspeed_config is not None:
        preset = load_preset(cfg.distributed_training.deepspeed_config)
    preset_stage = (preset or {}).get("zero_optimization", {}).get("stage", "auto")
    if preset_stage != "auto":
        return preset_stage
    stage = cfg.distributed_training.zero_stage
    return stage if stage is not None else (3 if world_size > 1 else 0)


def build_deepspeed_config(cfg: MetaseqConfig, world_size: int, fp16_supported: bool,
                           overlaps_communication: bool, bf16_matmul: bool = True) -> Dict[str, Any]:
    """The DeepSpeed config for this run: ours, then the preset's explicit values on top.

    `fp16_supported`, `overlaps_communication`, `bf16_matmul`: what the accelerator can do
    (`accelerator_traits`)."""
    common, dist_cfg = cfg.common, cfg.distributed_training
    fp16 = common.fp16
    bf16 = common.bf16
    if fp16 and not fp16_supported:
        fallback = "bf16" if bf16_matmul else f"fp32 ({SLOW_BF16})"
        # Warned from here, not the caller: one line a process, though the config is derived twice.
        warnings.warn(f"--fp16: this accelerator has no fp16 training support; using {fallback} instead")
        fp16, bf16 = False, bf16_matmul
    elif bf16 and not bf16_matmul:
        warnings.warn(f"--bf16: {SLOW_BF16}; training goes on in bf16 as asked, leave out --bf16 for "
                      "fp32's speed")
    tp_size = tensor_parallel_size(cfg)
    data_parallel_size = world_size // tp_size  # DeepSpeed's batch arithmetic counts data-parallel ranks
    preset = None if dist_cfg.deepspeed_config is None else load_preset(dist_cfg.deepspeed_config)
    stage = resolve_zero_stage(cfg, world_size, preset)  # the buckets are sized for the stage that runs
    one_zero3_rank = stage == 3 and data_parallel_size == 1
    zero: Dict[str, Any] = {"stage": stage, **_bucket_sizes(cfg.model, tp_size, prefetch_a_layer=overlaps_communication,
                                                          one_zero3_rank=one_zero3_rank)}
    if one_zero3_rank and not _offloads_parameters(preset):
        # One data-parallel rank: a gathered parameter is a view of its partition, and each
        # module's fetch of one synchronizes the device (the private_apis function says how).
        # Persistent ones are fetched once a step, as the same views: no memory added. Not with
        # parameter offload, where persistent parameters would stay on the device.
        zero["stage3_param_persistence_threshold"] = one_rank_persistence_threshold()
    if dist_cfg.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    derived: Dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.dataset.batch_size,
        "gradient_accumulation_steps": cfg.optimization.update_freq,
        "train_batch_size": cfg.dataset.batch_size * cfg.optimization.update_freq * data_parallel_size,
        "gradient_clipping": cfg.optimization.clip_norm,
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": fp16, "initial_scale_power": max(0, common.fp16_init_scale.bit_length() - 1)},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        # The optimizer is ours (--optimizer/--adam-impl), also under offload; with offload,
        # --adam-impl cpu_adam (DeepSpeedCPUAdam) is the fast choice.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # we log ourselves, in metaseq's format
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default) synchronizes the device at every forward
        # and step to time them, for a figure only its own progress print reports: on a GPU two
        # stalls of the host's run-ahead a micro-batch. Our log times updates by the wall clock.
        "timers": {"throughput": {"enabled": False}},
    }
    if tp_size > 1:
        # The model arrives sharded (`ds_autotp_parsed`); this makes the engine take DeepSpeed's
        # tensor/data-parallel groups as its mpu, so ZeRO reduces over the data-parallel group.
        derived["tensor_parallel"] = {"autotp_size": tp_size}
    if preset is None:
        return derived
    merged = _overlay(derived, preset)
    for key, flag in (("train_micro_batch_size_per_gpu", "--batch-size"), ("gradient_accumulation_steps", "--update-freq")):
        if merged[key] != derived[key]:
            raise UsageError(
                f"--deepspeed-config: {dist_cfg.deepspeed_config} sets {key}={merged[key]}; "
                f"set {flag} instead (or \"auto\") so the data loader agrees"
            )
    merged["train_batch_size"] = derived["train_batch_size"]
    preset_tp = merged.get("tensor_parallel", {}).get("autotp_size", 0)
    if preset_tp not in (0, 1, tp_size):
        raise UsageError(
            f"--deepspeed-config: {dist_cfg.deepspeed_config} sets tensor_parallel.autotp_size={preset_tp}; "
            f"set --model-parallel-size instead (the model is sharded by metaseq_ds's plan, not DeepSpeed's AutoTP)"
        )
    return merged


def training_precision(ds_config: Dict[str, Any]) -> str:
    """"bf16", "fp16" or "fp32": what a (derived or preset-merged) DeepSpeed config trains in."""
    return "bf16" if ds_config["bf16"]["enabled"] else "fp16" if ds_config["fp16"]["enabled"] else "fp32"


def accelerator_traits() -> Dict[str, bool]:
    """What `build_deepspeed_config` asks of this process's accelerator (DeepSpeed's choice)."""
    import deepspeed

    accelerator = deepspeed.get_accelerator()
    on_cpu = accelerator.device_name() == "cpu"
    return {"fp16_supported": bool(accelerator.is_fp16_supported()),
            "overlaps_communication": not on_cpu,
            "bf16_matmul": cpu_has_bf16_matmul() if on_cpu else True}


def _bucket_sizes(model_cfg, tp_size: int, prefetch_a_layer: bool, one_zero3_rank: bool) -> Dict[str, int]:
    """ZeRO's buffers and working sets sized by the model, so that a rank holds its share plus
    about one layer (12 d*d parameters for width d), whatever the model's size.

    DeepSpeed's defaults are fixed counts sized for large GPU models (5e8-element communication
    buckets, 1e9 live gathered parameters, optimizer sub-groups of 1e9 elements whose gradient is
    copied flat before each step): on a 0.7B model they double a rank's memory. The buckets are
    Hugging Face's "auto" values (d*d); the sub-group limit is one layer; the live-parameter and
    reuse-distance limits are one layer as this rank gathers it, its tensor-parallel share (at
    TP=2 a whole layer's count would keep two layers gathered). The sub-group limit stays one
    whole layer whatever the TP degree: it fixes the optimizer's flat groups in checkpoints.
    Models without a width (plugins) keep DeepSpeed's defaults.

    `prefetch_a_layer` (a GPU: collectives run on their own stream): ZeRO-3 gathers the next
    layer while this one computes, as FSDP does, so the live limit is two layers. DeepSpeed
    prefetches only within the live limit: with one layer live, it never prefetched, and each
    layer's gather waited in full. A CPU rank keeps one layer: gloo's collectives share the
    cores the step computes on, so there is nothing to overlap, and a layer more of memory.

    `one_zero3_rank` (ZeRO-3, one data-parallel rank): the reduce-scatter has nothing to
    communicate or overlap, but each bucket still costs DeepSpeed's host work (the bucket's
    reduce, its partition into the flat gradient buffer, an event), and buckets of d*d are ~12 a
    layer, ~290 a step at 24 layers. There a bucket holds a layer's gradients (as this rank has
    them): about one a layer. Its buffer is a layer's gradients, 1/(4L) to 1/(9L) of the rank's
    model states for L layers (fp32 / bf16 training: 1% or less at 24 layers). ZeRO-1/2 keep d*d:
    their one-data-parallel-rank layouts (tensor parallelism alone) are measured against the
    memory target with it."""
    if "decoder_embed_dim" not in model_cfg.__dataclass_fields__:
        return {}
    width = model_cfg.decoder_embed_dim
    layer = 12 * width * width
    gathered = layer // tp_size  # one layer, as this rank gathers it
    return {
        "reduce_bucket_size": gathered if one_zero3_rank else width * width,
        "allgather_bucket_size": width * width,
        "stage3_prefetch_bucket_size": gathered if prefetch_a_layer else 0,
        "stage3_param_persistence_threshold": 10 * width,
        "stage3_max_live_parameters": 2 * gathered if prefetch_a_layer else gathered,
        "stage3_max_reuse_distance": gathered,
        "sub_group_size": layer,
    }


def optimizer_group_limit(ds_config: Dict[str, Any], model_cfg) -> int:
    """The most parameters one torch optimizer group may hold under this config; 0: no limit.

    ZeRO-1/2 copy each group's gradient partition into one new flat tensor at every step while
    the per-parameter gradients still exist, so the largest group adds its size to the step's
    peak: a whole model in one group adds 4 bytes a parameter of the partition (on one
    data-parallel rank, a quarter of the model states again). Groups of one layer (12 d*d
    parameters, as ZeRO-3's sub-groups) bound that to one layer. Other stages keep one group."""
    if ds_config["zero_optimization"]["stage"] not in (1, 2) or "decoder_embed_dim" not in model_cfg.__dataclass_fields__:
        return 0
    return 12 * model_cfg.decoder_embed_dim ** 2


def parameter_groups(params: List[Any], limit: int) -> List[Any]:
    """`params` as they come (limit 0), else cut in order into groups of at most `limit` elements
    (a larger parameter alone), as torch param-group dicts that keep the optimizer's options."""
    if not limit:
        return params
    groups: List[List[Any]] = [[]]
    size = 0
    for param in params:
        if groups[-1] and size + param.numel() > limit:
            groups.append([])
            size = 0
        groups[-1].append(param)
        size += param.numel()
    return [{"params": group} for group in groups]


def _offloads_parameters(preset: Optional[Dict[str, Any]]) -> bool:
    device = (preset or {}).get("zero_optimization", {}).get("offload_param", {}).get("device", "none")
    return device not in ("none", None)


def _overlay(derived: Dict[str, Any], preset: Dict[str, Any]) -> Dict[str, Any]:
    """Preset values win, except "auto" ones, which keep the derived value."""
    out = copy.deepcopy(derived)
    for key, value in preset.items():
        if value == "auto":
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _overlay(out[key], value)
        elif isinstance(value, dict):
            out[key] = _overlay({}, value)
        else:
            out[key] = value
    return out
