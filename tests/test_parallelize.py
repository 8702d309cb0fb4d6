"""Activation checkpointing changes memory, not numerics or parameter names."""

import torch

from metaseq_ds.distributed.parallelize import parallelize
from metaseq_ds.models import build_model
from metaseq_ds.options import parse_train_config
from test_hf_parity import TinyTask


def _model_and_grads(argv):
    cfg = parse_train_config(["/data", "--arch", "transformer_lm_gpt2_tiny", "--tokens-per-sample", "16", *argv])
    torch.manual_seed(0)
    model = parallelize(build_model(cfg.model, TinyTask()), cfg)
    tokens = torch.randint(4, 40, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # same dropout masks in both runs, recomputation included
    model(tokens)[0].float().pow(2).mean().backward()
    return model, {name: p.grad for name, p in model.named_parameters()}


def test_checkpointed_layers_give_the_same_gradients_and_names():
    plain, plain_grads = _model_and_grads([])
    checkpointed, grads = _model_and_grads(["--checkpoint-activations"])
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert checkpointed.decoder.layers[0].forward.__name__ == "run"
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
