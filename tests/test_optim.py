"""Optimizers: updates against hand-written formulas, lr access, resume, registry and plugins."""

import argparse
import copy
import dataclasses
import math
from dataclasses import dataclass, field

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import env

from metaseq_ds.dataclass import MetaseqDataclass, validate_config
from metaseq_ds.errors import UsageError
from metaseq_ds.optim import (
    OPTIMIZER_REGISTRY,
    BaseOptimizer,
    LegacyOptimizer,
    MetaseqAdam,
    MetaseqAdamConfig,
    MetaseqSGDWConfig,
    build_optimizer,
    register_optimizer,
)

from metaseq_ds.optim.adam import adam_implementation

STEPS = 4


def fixed_grads(shape, steps=STEPS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def run(optimizer, param, grads, lrs=None):
    for t, grad in enumerate(grads):
        if lrs is not None:
            optimizer.set_lr(lrs[t])
        param.grad = grad.clone()
        optimizer.step()
        optimizer.zero_grad()


def adam_cfg(**overrides):
    values = dict(lr=1e-2, adam_betas=(0.9, 0.95), adam_eps=1e-8, weight_decay=0.1)
    values.update(overrides)
    return validate_config(MetaseqAdamConfig, values)


def reference_adamw(p, grads, lrs, betas, eps, weight_decay):
    """AdamW (Loshchilov & Hutter): bias-corrected moments, decay not passed through them."""
    p = p.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    beta1, beta2 = betas
    for t, (grad, lr) in enumerate(zip(grads, lrs), start=1):
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad * grad
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        p = p - lr * weight_decay * p - lr * m_hat / (v_hat.sqrt() + eps)
    return p


@pytest.mark.parametrize("impl", ["torch", "torch_fused"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_adamw_formula(weight_decay, impl):
    start = torch.randn(3, 2, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(start.clone())
    optimizer = build_optimizer(adam_cfg(weight_decay=weight_decay, adam_impl=impl), [param])
    lrs = [1e-2, 1e-2, 5e-3, 2e-2]  # the schedule changes the lr between steps
    grads = fixed_grads((3, 2))
    run(optimizer, param, grads, lrs)
    expected = reference_adamw(start, grads, lrs, (0.9, 0.95), 1e-8, weight_decay)
    torch.testing.assert_close(param.detach(), expected)


def test_adam_weight_decay_is_decoupled():
    """With a zero gradient Adam's step is 0, so only the decoupled decay moves the weights."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = build_optimizer(adam_cfg(lr=0.5, weight_decay=0.1), [param])
    run(optimizer, param, [torch.zeros(4)] * 2)
    torch.testing.assert_close(param.detach(), torch.full((4,), (1 - 0.5 * 0.1) ** 2))


@pytest.mark.parametrize("cuda", [False, True])
def test_adam_auto_is_torchs_fused_kernel_which_builds_nothing(cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert adam_implementation(adam_cfg()) == "torch_fused"


def test_a_deepspeed_adam_kernel_that_does_not_build_is_one_line_with_both_remedies(monkeypatch):
    from deepspeed.ops import op_builder

    def fail(self, verbose=True):  # what DeepSpeed 0.19's builder raised on torch 2.11 + CUDA 13 (issue 7589)
        raise ValueError("invalid literal for int() with base 10: '0a'")

    monkeypatch.setattr(op_builder.FusedAdamBuilder, "load", fail)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UsageError) as error:
        MetaseqAdam.check_kernels(adam_cfg(adam_impl="fused"))
    message = str(error.value)
    assert "\n" not in message and "FusedAdam" in message and "invalid literal for int()" in message
    assert "TORCH_CUDA_ARCH_LIST" in message and "--adam-impl torch_fused" in message


FAILING_BUILD = """
import sys
from deepspeed.ops import op_builder
from metaseq_ds.cli.main import main

def fail(self, verbose=True):
    raise ValueError("invalid literal for int() with base 10: '0a'")

op_builder.FusedAdamBuilder.load = fail
main(sys.argv[1:])
"""


def test_mseq_train_with_a_fused_adam_that_does_not_build_stops_before_writing(tmp_path):
    result = subprocess.run([sys.executable, "-c", FAILING_BUILD, "train", "--adam-impl", "fused", "--max-update", "1"],
                            capture_output=True, text=True, env=env(), timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("mseq train: error: --adam-impl fused: DeepSpeed's FusedAdam")
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in Path.cwd().iterdir()) == []  # no demo corpus, no checkpoints


def test_adam_implementation_on_cpu():
    param = torch.nn.Parameter(torch.zeros(2))
    assert build_optimizer(adam_cfg(), [param]).implementation == "torch_fused"  # auto without CUDA
    assert build_optimizer(adam_cfg(), [param]).optimizer.defaults["fused"]
    assert build_optimizer(adam_cfg(adam_impl="fused", use_old_adam=True), [param]).implementation == "torch"
    assert build_optimizer(adam_cfg(), [param]).optimizer_config == {
        "lr": 1e-2,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.1,
    }


def test_adam_config_validation():
    cfg = validate_config(MetaseqAdamConfig, {"adam_betas": [0.9, 0.95]})
    assert tuple(cfg.adam_betas) == (0.9, 0.95)
    with pytest.raises(UsageError, match="adam_impl"):
        validate_config(MetaseqAdamConfig, {"adam_impl": "apex"})


def reference_sgdw(p, grads, lr, momentum, weight_decay):
    p = p.clone()
    buf = None
    for grad in grads:
        buf = grad.clone() if buf is None else momentum * buf + grad
        p = p - lr * weight_decay * p - lr * buf
    return p


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.1)])
def test_sgdw_matches_formula(momentum, weight_decay):
    start = torch.randn(5, generator=torch.Generator().manual_seed(2))
    param = torch.nn.Parameter(start.clone())
    cfg = validate_config(MetaseqSGDWConfig, {"lr": 0.1, "momentum": momentum, "weight_decay": weight_decay})
    optimizer = build_optimizer(cfg, [param])
    grads = fixed_grads(5)
    run(optimizer, param, grads)
    torch.testing.assert_close(param.detach(), reference_sgdw(start, grads, 0.1, momentum, weight_decay))


def test_sgdw_updates_bf16_params_in_fp32():
    start = torch.randn(5, generator=torch.Generator().manual_seed(3))
    param = torch.nn.Parameter(start.to(torch.bfloat16))
    cfg = validate_config(MetaseqSGDWConfig, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1})
    optimizer = build_optimizer(cfg, [param])
    grads = fixed_grads(5, steps=1)
    run(optimizer, param, [g.to(torch.bfloat16) for g in grads])
    expected = reference_sgdw(start.to(torch.bfloat16).float(), [g.to(torch.bfloat16).float() for g in grads], 0.1, 0.9, 0.1)
    assert param.dtype == torch.bfloat16
    torch.testing.assert_close(param.detach(), expected.to(torch.bfloat16))


def test_set_lr_and_get_lr_reach_every_param_group():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer(adam_cfg(), [{"params": [a]}, {"params": [b], "weight_decay": 0.0}])
    assert optimizer.get_lr() == 1e-2
    optimizer.set_lr(3e-4)
    assert [group["lr"] for group in optimizer.optimizer.param_groups] == [3e-4, 3e-4]
    assert optimizer.get_lr() == 3e-4
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_build_optimizer_leaves_out_frozen_params():
    trained, frozen = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    optimizer = build_optimizer(adam_cfg(), [trained, frozen])
    assert list(optimizer.params) == [trained]


@pytest.mark.parametrize("cfg", [adam_cfg(), validate_config(MetaseqSGDWConfig, {"lr": 0.1, "momentum": 0.9})])
def test_state_dict_round_trip_resumes_identically(cfg):
    start = torch.randn(3, 2, generator=torch.Generator().manual_seed(4))
    grads = fixed_grads((3, 2), steps=4)
    param = torch.nn.Parameter(start.clone())
    optimizer = build_optimizer(cfg, [param])
    run(optimizer, param, grads[:2])
    # A deep copy, as saving a checkpoint makes: state_dict() returns the live state tensors.
    saved_param, saved_state = param.detach().clone(), copy.deepcopy(optimizer.state_dict())
    run(optimizer, param, grads[2:])

    resumed = torch.nn.Parameter(saved_param)
    resumed_optimizer = build_optimizer(cfg, [resumed])
    resumed_optimizer.load_state_dict(saved_state)
    run(resumed_optimizer, resumed, grads[2:])
    torch.testing.assert_close(resumed.detach(), param.detach(), rtol=0, atol=0)


def test_load_state_dict_overrides_take_the_current_flags():
    param = torch.nn.Parameter(torch.zeros(2))
    old = build_optimizer(adam_cfg(lr=1e-3), [param])
    new = build_optimizer(adam_cfg(lr=5e-4, weight_decay=0.0), [param])
    new.load_state_dict(old.state_dict(), optimizer_overrides=new.optimizer_config)
    assert new.get_lr() == 5e-4 and new.param_groups[0]["weight_decay"] == 0.0


def test_step_scale_divides_gradients():
    grads = fixed_grads(3, steps=1)
    plain, scaled = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    cfg = validate_config(MetaseqSGDWConfig, {"lr": 0.1})
    run(build_optimizer(cfg, [plain]), plain, grads)
    scaled_optimizer = build_optimizer(cfg, [scaled])
    scaled.grad = grads[0] * 8
    scaled_optimizer.step(scale=8.0)
    torch.testing.assert_close(scaled.detach(), plain.detach())


def test_clip_grad_norm():
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer(adam_cfg(), [param])
    param.grad = torch.tensor([3.0, 4.0])
    assert optimizer.clip_grad_norm(0.0).item() == pytest.approx(5.0)  # 0: measure only
    torch.testing.assert_close(param.grad, torch.tensor([3.0, 4.0]))
    assert optimizer.clip_grad_norm(1.0).item() == pytest.approx(5.0)
    torch.testing.assert_close(param.grad.norm(), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
    assert optimizer.clip_grad_norm(0.0, norm_type="inf").item() == pytest.approx(0.8, rel=1e-5)


def test_lr_follows_a_replaced_optimizer_object():
    """The trainer may point `.optimizer` at DeepSpeed's wrapper, which shares param_groups."""

    class Wrapper:
        def __init__(self, inner):
            self.param_groups = inner.param_groups

    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer(adam_cfg(), [param])
    torch_optimizer = optimizer.optimizer
    optimizer.optimizer = Wrapper(torch_optimizer)
    optimizer.set_lr(0.5)
    assert torch_optimizer.param_groups[0]["lr"] == 0.5


def test_registry_names_and_unknown_optimizer():
    assert {"adam", "sgd"} <= set(OPTIMIZER_REGISTRY.choices())
    cfg = adam_cfg()
    cfg._name = "adamm"  # instance attribute shadows the registered name
    with pytest.raises(UsageError, match="did you mean 'adam'"):
        build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])


@dataclass
class HalvingSGDConfig(MetaseqDataclass):
    lr: float = field(default=0.1, metadata={"help": "same as --lr"})


@register_optimizer("test_halving_sgd", dataclass=HalvingSGDConfig)
class HalvingSGD(BaseOptimizer):
    """A plugin: plain SGD at half the configured lr."""

    def __init__(self, cfg, params):
        super().__init__(cfg)
        self._optimizer = torch.optim.SGD(params, **self.optimizer_config)

    @property
    def optimizer_config(self):
        return {"lr": self.cfg.lr / 2}


@register_optimizer("test_legacy_sgd")
class LegacySGD(LegacyOptimizer):
    def __init__(self, args, params):
        super().__init__(args)
        self._optimizer = torch.optim.SGD(params, lr=self.args.lr[0])

    @property
    def optimizer_config(self):
        return {"lr": self.args.lr[0]}


def test_plugin_optimizers_build_and_step():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = build_optimizer(HalvingSGDConfig(lr=0.4), [param])
    assert isinstance(optimizer, HalvingSGD)
    run(optimizer, param, [torch.ones(2)])
    torch.testing.assert_close(param.detach(), torch.full((2,), 0.8))

    args = argparse.Namespace(_name="test_legacy_sgd", lr=[0.5])
    legacy = build_optimizer(args, [param])
    assert legacy.args is args and legacy.get_lr() == 0.5


def test_every_config_field_has_help():
    for name in ("adam", "sgd"):
        config = OPTIMIZER_REGISTRY.get(name).dataclass
        for config_field in dataclasses.fields(config):
            assert config.field_help(config_field.name), f"{name}.{config_field.name} has no help"


def test_weight_decay_shrinks_towards_zero_at_lr_times_wd():
    """SGDW with no gradient signal: p_t = p_0 * (1 - lr*wd)**t exactly."""
    param = torch.nn.Parameter(torch.full((3,), 2.0))
    cfg = validate_config(MetaseqSGDWConfig, {"lr": 0.5, "weight_decay": 0.2, "momentum": 0.9})
    optimizer = build_optimizer(cfg, [param])
    run(optimizer, param, [torch.zeros(3)] * 3)
    torch.testing.assert_close(param.detach(), torch.full((3,), 2.0 * (1 - 0.1) ** 3))
    assert math.isclose(optimizer.get_lr(), 0.5)
