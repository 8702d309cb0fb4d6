"""`modules.Linear`: nn.Linear's parameters and results, with fp32 CPU products on oneDNN."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metaseq_ds.modules import Linear
from metaseq_ds.modules.linear import (ONEDNN_MIN_ROWS, ONEDNN_MIN_WEIGHT, ROW_TILES, _row_parts,
                                       lay_out_for_decoding, transposed_product_, uses_onednn)

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


@pytest.mark.parametrize("dtype, out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.float32)])
@pytest.mark.parametrize("rows", [100, 128, 40])
def test_a_transposed_product_in_parts_of_rows_equals_the_whole_one(dtype, out_dtype, rows, monkeypatch):
    monkeypatch.setitem(ROW_TILES, ("cpu", dtype), 64)
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(24, n, generator=generator).to(dtype) for n in (rows, 16))
    whole = torch.mm(a.t(), b).to(out_dtype)  # the operands' dtype, as the parts are
    out = torch.full((rows, 16), float("nan"), dtype=out_dtype)  # written, not read
    assert transposed_product_(out, a, b, add=False) is out
    torch.testing.assert_close(out, whole)
    transposed_product_(out, a, b)
    torch.testing.assert_close(out, 2 * whole)


def test_only_bf16_cpu_products_are_cut_at_a_multiple_of_64_rows(monkeypatch):
    bf16, fp32 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert _row_parts(50272, bf16) == [slice(0, 50240), slice(50240, 50272)]  # OPT's vocabulary
    assert _row_parts(50304, bf16) == [slice(0, 50304)]
    assert _row_parts(40, bf16) == [slice(0, 40)]  # fewer rows than a tile: one product
    assert _row_parts(50272, fp32) == [slice(0, 50272)]
    monkeypatch.setitem(ROW_TILES, ("cpu", torch.float32), 64)
    assert _row_parts(50272, fp32) == [slice(0, 50240), slice(50240, 50272)]
