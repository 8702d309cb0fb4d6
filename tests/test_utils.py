"""metaseq_ds.utils: each helper against the behaviour of metaseq's (or fairseq's) `utils.X`."""

import math
import os
import warnings
from argparse import Namespace
from collections import namedtuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from device_check import MetaDeviceCheck
from metaseq_ds import utils
from metaseq_ds.incremental_decoding_utils import with_incremental_state
from metaseq_ds.models import transformer_decoder
from migrate.resolve import ModuleIndex


def test_every_public_name_is_visible_to_mseq_migrate():
    """`mseq migrate` resolves `utils.X` by reading the source: every helper must be seen there."""
    assert set(utils.__all__) <= ModuleIndex().names("metaseq_ds.utils")
    assert all(callable(getattr(utils, name)) for name in utils.__all__)


def test_item_unwraps_tensors_numpy_scalars_and_sequences():
    assert utils.item(torch.tensor(2.5)) == 2.5 and isinstance(utils.item(torch.tensor(2.5)), float)
    assert utils.item(torch.tensor([7])) == 7
    assert utils.item(np.float32(1.5)) == 1.5 and isinstance(utils.item(np.float32(1.5)), float)
    assert utils.item([4, 5]) == 4
    assert utils.item(3.0) == 3.0


def test_get_perplexity_is_base_2_rounded_and_safe():
    assert utils.get_perplexity(3.0) == 8.0
    assert utils.get_perplexity(torch.tensor(1.0), round=3, base=math.e) == 2.718
    assert utils.get_perplexity(None) == 0.0
    assert utils.get_perplexity(1e6) == math.inf


def test_activation_fns_are_the_decoders_own():
    for name in ("relu", "gelu"):
        assert utils.get_activation_fn(name) is transformer_decoder.ACTIVATIONS[name]
    x = torch.linspace(-3, 3, 13)
    fairseq_gelu_accurate = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3))))
    torch.testing.assert_close(utils.get_activation_fn("gelu_accurate")(x), fairseq_gelu_accurate)
    torch.testing.assert_close(utils.get_activation_fn("gelu")(x), F.gelu(x))
    torch.testing.assert_close(utils.get_activation_fn("relu_squared")(x), F.relu(x) ** 2)
    assert utils.get_activation_fn("linear")(x) is x
    for name in utils.get_available_activation_fns():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert utils.get_activation_fn(name)(x).shape == x.shape, name
    with pytest.raises(RuntimeError, match="--activation-fn softplus not supported"):
        utils.get_activation_fn("softplus")


def test_gelu_fast_warns_at_the_caller_and_is_gelu_accurate():
    with pytest.warns(UserWarning, match="renamed to gelu_accurate") as record:
        fn = utils.get_activation_fn("gelu_fast")
    assert fn is utils.get_activation_fn("gelu_accurate")
    assert record[0].filename == __file__


def test_deprecation_warning_is_shown_by_default():
    def old_api():
        utils.deprecation_warning("old_api is deprecated")

    with pytest.warns(UserWarning, match="old_api is deprecated") as record:
        old_api()
    assert not issubclass(record[0].category, DeprecationWarning)
    assert record[0].filename == __file__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_softmax_and_log_softmax_are_fp32(dtype):
    x = torch.randn(2, 5).to(dtype)
    probs = utils.softmax(x, dim=-1)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))
    torch.testing.assert_close(utils.log_softmax(x, dim=-1, onnx_trace=True), probs.log())


def test_strip_pad_drops_pad_ids():
    assert utils.strip_pad(torch.tensor([[5, 6, 1], [1, 7, 1]]), pad=1).tolist() == [5, 6, 7]


def test_make_positions_count_from_padding_idx_plus_one_and_pads_keep_it():
    tokens = torch.tensor([[5, 6, 7, 1, 1], [1, 1, 8, 9, 4]])
    expected = [[2, 3, 4, 1, 1], [1, 1, 2, 3, 4]]
    assert utils.make_positions(tokens, padding_idx=1).tolist() == expected
    assert utils.make_positions(tokens, 1, onnx_trace=True).tolist() == expected
    assert utils.make_positions(tokens, 1).dtype == torch.long


def test_apply_to_sample_recurses_through_containers_and_keeps_the_rest():
    Pair = namedtuple("Pair", "a b")
    t = torch.ones(2)
    sample = {"net_input": {"src_tokens": t, "lengths": [t, (t, "x")]}, "id": 3, "pair": Pair(t, None),
              "set": {t}}
    out = utils.apply_to_sample(lambda x: x * 2, sample)
    assert out["net_input"]["src_tokens"].tolist() == [2, 2]
    assert out["net_input"]["lengths"][1][0].tolist() == [2, 2] and out["net_input"]["lengths"][1][1] == "x"
    assert isinstance(out["net_input"]["lengths"], list) and isinstance(out["net_input"]["lengths"][1], tuple)
    assert out["id"] == 3 and isinstance(out["pair"], Pair) and out["pair"].a.tolist() == [2, 2]
    assert [x.tolist() for x in out["set"]] == [[2, 2]]
    assert sample["net_input"]["src_tokens"] is t  # the input is not modified


def test_apply_to_sample_on_an_empty_sample_is_an_empty_dict():
    assert utils.apply_to_sample(lambda x: x, []) == {} and utils.apply_to_sample(lambda x: x, {}) == {}


def test_move_to_cuda_moves_to_the_given_device_or_the_current_cuda_device():
    sample = {"x": torch.ones(2), "n": [torch.zeros(1)]}
    moved = utils.move_to_cuda(sample, device="meta")
    assert moved["x"].is_meta and moved["n"][0].is_meta
    if torch.cuda.is_available():
        assert utils.move_to_cuda(sample)["x"].device == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(RuntimeError, match="no CUDA device here; pass device="):
            utils.move_to_cuda(sample)


def test_move_to_cpu_casts_half_precision_to_fp32_unless_asked_not_to():
    sample = {"h": torch.ones(2, dtype=torch.bfloat16), "i": torch.ones(2, dtype=torch.long)}
    out = utils.move_to_cpu(sample)
    assert out["h"].dtype == torch.float32 and out["i"].dtype == torch.long and out["h"].device.type == "cpu"
    assert utils.move_to_cpu(sample, cast_to_fp32=False)["h"].dtype == torch.bfloat16


def test_set_torch_seed_seeds_and_restores_the_rng_state_on_exit():
    before = torch.get_rng_state()
    with utils.set_torch_seed(1234):
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with utils.set_torch_seed(1234):
        assert torch.equal(torch.rand(3), first)
    after_block = torch.rand(3)
    torch.set_rng_state(before)
    assert torch.equal(torch.rand(3), after_block)  # the draws outside the block are as without it


def test_set_torch_seed_as_a_plain_call_seeds():
    state = torch.get_rng_state()
    try:
        utils.set_torch_seed(7)
        first = torch.rand(2)
        utils.set_torch_seed(7)
        assert torch.equal(torch.rand(2), first)
    finally:
        torch.set_rng_state(state)
    with pytest.raises(TypeError, match="seed must be an int"):
        utils.set_torch_seed(1.5)


def _params_with_grads(*grads):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params


def test_clip_grad_norm_returns_the_norm_before_clipping_and_scales_the_grads():
    params = _params_with_grads(torch.tensor([3.0]), torch.tensor([4.0]))
    norm = utils.clip_grad_norm_(params, max_norm=1.0)
    assert norm.item() == pytest.approx(5.0) and norm.dtype == torch.float32
    torch.testing.assert_close(torch.cat([p.grad for p in params]), torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_max_norm_0_only_measures_and_inf_norm_is_the_largest():
    params = _params_with_grads(torch.tensor([3.0, -4.0]), torch.tensor([2.0]))
    assert utils.clip_grad_norm_(params, 0).item() == pytest.approx(math.sqrt(29))
    assert utils.clip_grad_norm_(params, 0, norm_type="inf").item() == 4.0
    assert params[0].grad.tolist() == [3.0, -4.0]
    with pytest.raises(ValueError, match="norm_type 'l1'"):
        utils.clip_grad_norm_(params, 1.0, norm_type="l1")


def test_clip_grad_norm_aggregates_before_clipping():
    params = _params_with_grads(torch.tensor([3.0, 4.0]))
    norm = utils.clip_grad_norm_(params, 1.0, aggregate_norm_fn=lambda local: local * 2)  # e.g. another rank's half
    assert norm.item() == pytest.approx(10.0)
    torch.testing.assert_close(params[0].grad, torch.tensor([0.3, 0.4]), rtol=1e-5, atol=1e-6)


def test_clip_grad_norm_of_bf16_grads_is_fp32_and_skips_params_without_grads():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    p.grad = torch.full((3,), 1.01, dtype=torch.bfloat16)
    norm = utils.clip_grad_norm_([p, torch.nn.Parameter(torch.zeros(1)), None], 0)
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(math.sqrt(3) * p.grad[0].float().item(), rel=1e-6)
    assert utils.clip_grad_norm_([torch.nn.Parameter(torch.zeros(1))], 1.0).item() == 0.0
    assert utils.clip_grad_norm_(p, 0).item() == norm.item()  # a single tensor is a list of one


def test_clip_grad_norm_stays_on_the_gradients_device():
    params = [torch.nn.Parameter(torch.zeros(4, device="meta")) for _ in range(2)]
    for p in params:
        p.grad = torch.ones(4, device="meta")
    with MetaDeviceCheck() as check:  # a CPU tensor mixed into the device's would fail on a GPU
        norm = utils.clip_grad_norm_(params, 1.0, aggregate_norm_fn=lambda local: local * 2)
    assert norm.is_meta and check.host_reads == []


def test_has_parameters():
    assert utils.has_parameters(torch.nn.Linear(2, 2))
    assert not utils.has_parameters(torch.nn.ReLU())


@pytest.mark.parametrize("limits, expected", [
    ((), None),
    ((None, None), None),
    ((None, 512, 1024), 512),
    (((512, None), (1024, 256)), (512, 256)),
    ((300, (512, None)), (300, 300)),
    (((512, 100), 300), (300, 100)),
    (({"a": 10, "b": 20}, {"b": 5, "c": 7}), {"a": 10, "b": 5, "c": 7}),
    (({"a": 10, "b": 20}, 15), {"a": 10, "b": 15}),
])
def test_resolve_max_positions_takes_the_tightest_limit(limits, expected):
    assert utils.resolve_max_positions(*limits) == expected


def test_fill_with_neg_inf_keeps_the_dtype():
    filled = utils.fill_with_neg_inf(torch.zeros(2, 2, dtype=torch.float16))
    assert filled.dtype == torch.float16 and torch.isneginf(filled).all()


def test_index_put_assigns_in_place_and_returns_the_tensor():
    t = torch.zeros(3)
    assert utils.index_put(t, torch.tensor([True, False, True]), 5.0) is t
    assert t.tolist() == [5.0, 0.0, 5.0]


def test_incremental_state_helpers_go_through_the_modules_own_keys():
    @with_incremental_state
    class Cache(torch.nn.Module):
        pass

    a, b, state = Cache(), Cache(), {}
    assert utils.set_incremental_state(a, state, "kv", {"k": 1}) is state
    assert utils.get_incremental_state(a, state, "kv") == {"k": 1}
    assert utils.get_incremental_state(b, state, "kv") is None  # each module has keys of its own
    assert utils.set_incremental_state(a, None, "kv", {"k": 2}) is None


def test_import_user_module_imports_args_user_dir(tmp_path):
    plugin = tmp_path / "utils_test_plugin_pkg"
    plugin.mkdir()
    (plugin / "__init__.py").write_text("LOADED = True\n")
    utils.import_user_module(Namespace(user_dir=str(plugin)))
    import sys

    try:
        assert sys.modules["utils_test_plugin_pkg"].LOADED
    finally:
        del sys.modules["utils_test_plugin_pkg"]
    utils.import_user_module(Namespace())  # no --user-dir: nothing to do
    utils.import_user_module(Namespace(user_dir=None))


def test_split_paths_splits_on_pathsep_or_on_bar_for_urls():
    assert utils.split_paths(os.pathsep.join(["/d/a", "/d/b"])) == ["/d/a", "/d/b"]
    assert utils.split_paths("s3://b/a|s3://b/c") == ["s3://b/a", "s3://b/c"]


def test_flag_parsers():
    assert utils.eval_str_list("[0.9, 0.98]") == [0.9, 0.98]
    assert utils.eval_str_list("(1, 2)", type=int) == [1, 2]
    assert utils.eval_str_list(0.5) == [0.5] and utils.eval_str_list(None) is None
    assert utils.csv_str_list("a,b") == ["a", "b"]
    assert utils.eval_bool("True") is True and utils.eval_bool("0") is False
    assert utils.eval_bool(None, default=True) is True and utils.eval_bool(True) is True
    with pytest.raises(ValueError):
        utils.eval_str_list("__import__('os').getcwd()")  # flags are data, never run


def test_safe_getattr_and_safe_hasattr():
    ns = Namespace(a=1, b=None)
    assert utils.safe_getattr(ns, "a") == 1 and utils.safe_getattr(ns, "c", 3) == 3
    assert utils.safe_hasattr(ns, "a") and not utils.safe_hasattr(ns, "b") and not utils.safe_hasattr(ns, "c")
