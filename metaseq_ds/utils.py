"""The helpers that fairseq and metaseq plugins call as `utils.X`, with metaseq's semantics.

    from metaseq_ds import utils          # `from fairseq import utils` after `mseq migrate`
    loss = utils.item(loss)
    with utils.set_torch_seed(seed):
        ...

Chosen by counting `utils.X` in fairseq's `examples/` and in metaseq's own package (commits
3d262bb and f7ffa5f): item (27 / 1), move_to_cuda (13 / 3), split_paths (6 / 5),
set_torch_seed (5 / 5), resolve_max_positions (4 / 4), import_user_module (4 / 5),
strip_pad (5 / 0), softmax (4 / 2), has_parameters (0 / 4), get_perplexity (3 / 3), then
fewer. Encoder-decoder, TPU and alignment helpers are left out (docs/migration.md says so).
Where metaseq_ds already does the job the helper is that code under fairseq's name:
`make_positions` (modules.positional_embedding), `get_perplexity` (logging.metrics),
`import_user_module` (user_code), `move_to_cuda` (device.to_device), activations
(modules.activations).
"""

import ast
import math
import os
import warnings
from typing import Callable, List

import torch
import torch.nn.functional as F

from metaseq_ds import user_code
from metaseq_ds.device import map_tensors, to_device
from metaseq_ds.logging.metrics import get_perplexity
from metaseq_ds.modules import positional_embedding
from metaseq_ds.modules.activations import ACTIVATIONS

__all__ = [
    "apply_to_sample",
    "clip_grad_norm_",
    "csv_str_list",
    "deprecation_warning",
    "eval_bool",
    "eval_str_list",
    "fill_with_neg_inf",
    "get_activation_fn",
    "get_available_activation_fns",
    "get_incremental_state",
    "get_perplexity",
    "get_rng_state",
    "has_parameters",
    "import_user_module",
    "index_put",
    "item",
    "log_softmax",
    "make_positions",
    "move_to_cpu",
    "move_to_cuda",
    "resolve_max_positions",
    "safe_getattr",
    "safe_hasattr",
    "set_incremental_state",
    "set_rng_state",
    "set_torch_seed",
    "softmax",
    "split_paths",
    "strip_pad",
]


# Samples: nested dicts, lists, tuples and sets of tensors.


def apply_to_sample(f: Callable[[torch.Tensor], torch.Tensor], sample):
    """`sample` with `f` applied to each of its tensors. An empty sample gives `{}` (metaseq's
    trainers test for an empty dict, whatever container the sample was)."""
    if hasattr(sample, "__len__") and len(sample) == 0:
        return {}
    return map_tensors(sample, f)


def move_to_cuda(sample, device=None):
    """`sample` on `device` (default: the current CUDA device), copied `non_blocking`.

    Any device works when given (`device="cpu"`, a `torch.device`, an index); without one and
    without CUDA this raises instead of leaving the sample where it is."""
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "utils.move_to_cuda: no CUDA device here; pass device=, or use "
                "metaseq_ds.device.to_device(sample, module_device(model))")
        device = torch.cuda.current_device()
    return apply_to_sample(lambda tensor: to_device(tensor, device), sample)


def move_to_cpu(sample, cast_to_fp32: bool = True):
    """`sample` on the CPU; fp16 and bf16 tensors become fp32 unless `cast_to_fp32=False`
    (metaseq's default: many CPU ops lack half-precision kernels)."""

    def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
        if cast_to_fp32 and tensor.dtype in (torch.float16, torch.bfloat16):
            tensor = tensor.float()
        return tensor.cpu()

    return apply_to_sample(to_cpu, sample)


def item(tensor):
    """A one-element tensor (or numpy scalar) as a Python number, the first element of a
    sequence, anything else as it is. A CUDA tensor's `.item()` waits for the device."""
    if hasattr(tensor, "item"):
        return tensor.item()
    if hasattr(tensor, "__getitem__"):
        return tensor[0]
    return tensor


def split_paths(paths: str, separator: str = os.pathsep) -> List[str]:
    """`--data` with several directories: split on `separator`, or on "|" when the paths are
    URLs (their "://" holds the path separator ":")."""
    return paths.split(separator) if "://" not in paths else paths.split("|")


# Tokens and positions.


def strip_pad(tensor: torch.Tensor, pad: int) -> torch.Tensor:
    """The elements of `tensor` that are not `pad`, flattened to 1-D."""
    return tensor[tensor.ne(pad)]


def make_positions(tensor: torch.Tensor, padding_idx: int, onnx_trace: bool = False) -> torch.Tensor:
    """Positions of the non-pad tokens from `padding_idx + 1`; pads keep `padding_idx`.
    `onnx_trace` is fairseq's export switch and changes nothing (fairseq ignored it too)."""
    return positional_embedding.make_positions(tensor, padding_idx)


def resolve_max_positions(*args):
    """The tightest of several max-positions limits (a task's, a model's, a flag's).

    Each is None (no limit), a number, a tuple (one limit per input, None: no limit) or a dict
    of those by name. A number against a tuple or dict limits every entry."""
    max_positions = None
    for arg in args:
        if arg is None:
            continue
        if max_positions is None:
            max_positions = arg
            continue
        max_positions, arg = _match_types(max_positions, arg)
        if isinstance(arg, (int, float)):
            max_positions = min(max_positions, arg)
        elif isinstance(arg, dict):
            max_positions = {**max_positions,
                             **{key: min(max_positions[key], value) if key in max_positions else value
                                for key, value in arg.items()}}
        else:
            max_positions = tuple(min((x for x in pair if x is not None), default=None)
                                  for pair in zip(max_positions, arg))
    return max_positions


def _match_types(limit_a, limit_b):
    """Both limits in the same shape: a number becomes a tuple or dict of itself like the other."""

    def spread(number, like):
        if isinstance(like, tuple):
            return (number,) * len(like)
        if isinstance(like, dict):
            return {key: spread(number, value) for key, value in like.items()}
        return number

    if isinstance(limit_a, (int, float)):
        return spread(limit_a, limit_b), limit_b
    if isinstance(limit_b, (int, float)):
        return limit_a, spread(limit_b, limit_a)
    return limit_a, limit_b


# Numerics.


def softmax(x: torch.Tensor, dim: int, onnx_trace: bool = False) -> torch.Tensor:
    """Softmax computed and returned in fp32 whatever `x`'s dtype. `onnx_trace` (fairseq's)
    gives the same numbers and is accepted for its callers."""
    return F.softmax(x, dim=dim, dtype=torch.float32)


def log_softmax(x: torch.Tensor, dim: int, onnx_trace: bool = False) -> torch.Tensor:
    """Log-softmax computed and returned in fp32; `onnx_trace` as in `softmax`."""
    return F.log_softmax(x, dim=dim, dtype=torch.float32)


def fill_with_neg_inf(t: torch.Tensor) -> torch.Tensor:
    """`t` filled with -inf in its own dtype (the fill goes through fp32 for fp16 tensors)."""
    return t.float().fill_(float("-inf")).type_as(t)


def index_put(tensor: torch.Tensor, indices: torch.Tensor, value) -> torch.Tensor:
    """`tensor[indices] = value`, returning `tensor` (fairseq's XLA branch is not needed here)."""
    tensor[indices] = value
    return tensor


_NORM_ORDERS = {"l2": 2.0, "inf": math.inf}


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: str = "l2", aggregate_norm_fn=None,
                    device=None) -> torch.Tensor:
    """Scale the gradients of `params` so their total norm is at most `max_norm` (0: only
    measure); return the norm before clipping, an fp32 0-dim tensor.

    The norm is of this process's gradients: where they are a part of the model's (tensor
    parallelism, ZeRO), `aggregate_norm_fn` turns it into the whole model's norm before the
    clip, as metaseq's optimizers do. The norm lives on the gradients' device (or `device`)."""
    if norm_type not in _NORM_ORDERS:
        raise ValueError(f"clip_grad_norm_: norm_type {norm_type!r} is not one of {sorted(_NORM_ORDERS)}")
    if torch.is_tensor(params):
        params = [params]
    with_grads = [p for p in params if p is not None and p.grad is not None]
    order = _NORM_ORDERS[norm_type]
    if not with_grads:
        total_norm = torch.zeros((), dtype=torch.float32, device=device)
    else:
        norm_device = device if device is not None else with_grads[0].grad.device
        # fp32 per-gradient norms, as metaseq: a bf16 norm keeps about three significant digits.
        norms = [torch.linalg.vector_norm(p.grad, order, dtype=torch.float32).to(norm_device) for p in with_grads]
        total_norm = torch.linalg.vector_norm(torch.stack(norms), order)
    if aggregate_norm_fn is not None:
        total_norm = aggregate_norm_fn(total_norm)
    if max_norm > 0 and with_grads:
        torch.nn.utils.clip_grads_with_norm_(with_grads, float(max_norm), total_norm)
    return total_norm


# Modules.


def has_parameters(module: torch.nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def get_incremental_state(module, incremental_state, key: str):
    """`module`'s cached value under `key` (see metaseq_ds.incremental_decoding_utils)."""
    return module.get_incremental_state(incremental_state, key)


def set_incremental_state(module, incremental_state, key: str, value):
    """Cache `value` under `key` for `module`; returns the state (None stays None)."""
    if incremental_state is not None:
        result = module.set_incremental_state(incremental_state, key, value)
        if result is not None:
            incremental_state = result
    return incremental_state


def get_activation_fn(activation: str) -> Callable:
    """The activation function named by `--activation-fn` (the decoder's own for relu and gelu)."""
    if activation == "gelu_fast":
        deprecation_warning("--activation-fn=gelu_fast has been renamed to gelu_accurate")
        activation = "gelu_accurate"
    if activation not in ACTIVATIONS:
        raise RuntimeError(f"--activation-fn {activation} not supported (choose from {get_available_activation_fns()})")
    return ACTIVATIONS[activation]


def get_available_activation_fns() -> List[str]:
    """Every name `get_activation_fn` takes, "gelu_fast" (deprecated) included: `choices=` for flags."""
    return list(ACTIVATIONS) + ["gelu_fast"]


# Random number generators.


def get_rng_state() -> dict:
    state = {"torch_rng_state": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_rng_state"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch_rng_state"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng_state"])


class set_torch_seed:
    """Seed torch's CPU and CUDA generators now; as a context manager, restore their states on exit.

        with utils.set_torch_seed(cfg.common.seed):   # the same draws every time, then as before
            sample = draw()
        utils.set_torch_seed(seed)                    # a plain call seeds and keeps the seed

    Every CUDA device's state is saved and restored (metaseq restored the current one's only)."""

    def __init__(self, seed: int):
        if not isinstance(seed, int):
            raise TypeError(f"set_torch_seed: seed must be an int, not {type(seed).__name__}")
        self.rng_state = get_rng_state()
        torch.manual_seed(seed)  # seeds every CUDA device too

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        set_rng_state(self.rng_state)


# Plugins, flags and messages.


def import_user_module(args) -> None:
    """Import `args.user_dir`, the plugin package, if the namespace names one."""
    # getattr: metaseq's callers pass any namespace, many without a user_dir at all.
    user_dir = getattr(args, "user_dir", None)
    if user_dir is not None:
        user_code.import_user_module(user_dir)


def deprecation_warning(message: str, stacklevel: int = 3) -> None:
    """A UserWarning, not a DeprecationWarning: Python hides those by default."""
    warnings.warn(message, stacklevel=stacklevel)


def csv_str_list(x: str) -> List[str]:
    return x.split(",")


# ast.literal_eval, not fairseq's eval: the same values for the lists, tuples and booleans that
# flags hold, without running code from a config file.


def eval_str_list(x, type=float):
    """A flag's "[0.9, 0.98]" (or a list, or a single value) as a list of `type`; None stays None."""
    if x is None:
        return None
    if isinstance(x, str):
        x = ast.literal_eval(x)
    try:
        return list(map(type, x))
    except TypeError:
        return [type(x)]


def eval_bool(x, default: bool = False) -> bool:
    """A flag's "True" / "0" / "False" as a bool; None gives `default`."""
    if x is None:
        return default
    if not isinstance(x, str):
        return bool(x)
    return bool(ast.literal_eval(x))


def safe_getattr(obj, k: str, default=None):
    """fairseq's `getattr` with a default; its OmegaConf branch has no use here (configs are dataclasses)."""
    return getattr(obj, k, default)


def safe_hasattr(obj, k: str) -> bool:
    """Whether `obj.k` exists and is not None."""
    return getattr(obj, k, None) is not None
