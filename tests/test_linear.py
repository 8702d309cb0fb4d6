"""`modules.Linear`: nn.Linear's parameters and results, with fp32 CPU products on oneDNN."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metaseq_ds.modules import Linear
from metaseq_ds.modules.linear import ONEDNN_MIN_ROWS, ONEDNN_MIN_WEIGHT, lay_out_for_decoding, uses_onednn

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


@pytest.mark.parametrize(
    "shape, out_features, bias",
    [
        ((4, 16, 24), 40, True),  # a (B, T, C) batch, as in the decoder
        ((64, 24), 40, False),
        ((40, 24), 300, False),  # more outputs than rows: the vocabulary projection's backward
    ],
)
def test_forward_and_gradients_match_f_linear(shape, out_features, bias):
    generator = torch.Generator().manual_seed(0)
    layer = Linear(shape[-1], out_features, bias=bias)
    x = torch.randn(*shape, generator=generator, requires_grad=True)
    grad = torch.randn(*shape[:-1], out_features, generator=generator)
    assert uses_onednn(x, layer.weight)

    layer(x).backward(grad)
    ours = [x.grad] + [p.grad for p in layer.parameters()]
    x.grad = None
    layer.zero_grad()
    F.linear(x, layer.weight, layer.bias).backward(grad)
    reference = [x.grad] + [p.grad for p in layer.parameters()]
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_decoding_rows_low_precision_and_autocast_keep_f_linear():
    layer = Linear(16, 8)
    assert not uses_onednn(torch.randn(ONEDNN_MIN_ROWS - 1, 16), layer.weight)
    assert not uses_onednn(torch.randn(64, 16, dtype=torch.bfloat16), layer.weight.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(64, 16)).dtype == torch.bfloat16


def test_is_an_nn_linear_with_its_state_dict():
    layer = Linear(16, 8)
    assert isinstance(layer, nn.Linear)
    assert list(layer.state_dict()) == list(nn.Linear(16, 8).state_dict())


@pytest.mark.parametrize("laid_out", [False, True], ids=["as_trained", "laid_out_for_decoding"])
def test_a_decoding_step_through_a_large_weight_runs_on_onednn_and_matches(laid_out):
    generator = torch.Generator().manual_seed(0)
    layer = Linear(1024, ONEDNN_MIN_WEIGHT // 1024)
    if laid_out:
        lay_out_for_decoding(layer)
    x = torch.randn(2, 1, 1024, generator=generator)  # one new token for each of two rows
    assert uses_onednn(x, layer.weight)
    assert not uses_onednn(x[..., :512], Linear(512, 512).weight)  # a small weight stays on F.linear
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight.contiguous(), layer.bias), rtol=1e-5, atol=1e-5)


def test_lay_out_for_decoding_moves_weights_without_changing_them():
    model = nn.Sequential(nn.Embedding(10, 6), Linear(6, 10, bias=False), nn.Linear(6, 3))
    model[1].weight = model[0].weight  # tied, as OPT's output projection
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    lay_out_for_decoding(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor) and after[name].shape == tensor.shape
    assert model[1].weight is model[0].weight and model[1].weight.t().is_contiguous()
    assert model[2].weight.stride() == (1, 3)  # (in, out) in memory
    lay_out_for_decoding(model)  # a second call changes nothing
    assert model[2].weight.stride() == (1, 3)
