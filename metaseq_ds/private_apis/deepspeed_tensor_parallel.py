"""DeepSpeed's tensor-parallel groups and layers (deepspeed 0.19): set up before the model exists,
and forwards that keep ZeRO-3 from holding gathered weights."""

from typing import Any, Callable, Optional

from metaseq_ds.private_apis.verified import relies_on


@relies_on("deepspeed", "deepspeed.utils.groups._init_tp_mesh_device",
           written_for="0.19", cuda=True,
           why="the (data-parallel x tensor-parallel) groups are needed before the model exists (each rank builds "
               "only its shard); DeepSpeed makes them only inside deepspeed.initialize (AutoTP). Related: "
               "https://github.com/deepspeedai/DeepSpeed/issues/7680 (one public mesh API, open)",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def init_tensor_parallel_groups(tensor_parallel_size: int) -> None:
    """DeepSpeed's (data-parallel x tensor-parallel) groups, ranks r..r+N-1 forming one TP group:
    what its AutoTP sets up through `deepspeed.initialize`, needed here before the model exists."""
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tensor_parallel_size)


@relies_on("deepspeed", "deepspeed.utils.groups._TENSOR_MODEL_PARALLEL_GROUP",
           written_for="0.19", cuda=True,
           why="DeepSpeed keeps no public flag for its tensor-parallel groups",
           test="tests/test_private_apis.py::test_deepspeed_shims_in_a_one_rank_process")
def tensor_parallel_groups_initialized() -> bool:
    """Whether `init_tensor_parallel_groups` ran in this process (DeepSpeed keeps no public flag)."""
    from deepspeed.utils import groups

    return groups._TENSOR_MODEL_PARALLEL_GROUP is not None


@relies_on("deepspeed", "deepspeed.module_inject.tp_shard.AutoTPMeta",
           written_for="0.19", cuda=True,
           why="checkpoints merge tensor-parallel parts as equal parts, so every dimension is split with grain 1, "
               "said explicitly: 0.19's training default is 1 already (AutoTPMeta), but its inference config rounds "
               "to 64 (https://github.com/deepspeedai/DeepSpeed/pull/4697); can go once the default is promised",
           test="tests/test_private_apis.py::test_even_split_meta_splits_every_dimension_into_equal_parts")
def even_split_tp_meta():
    """The `tp_meta` argument of DeepSpeed's TP layers that splits every dimension into exactly
    equal parts (grain 1): our checks guarantee divisibility, and checkpoints merge by equal parts."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    return AutoTPMeta(tp_grain_size=1)


@relies_on("deepspeed", "module_inject.layers' tensor-parallel autograd functions and layer attributes",
           written_for="0.19", cuda=True,
           why="DeepSpeed's TP layers multiply by self.weight.transpose(-1, -2); autograd saves that view, which "
               "keeps every layer's ZeRO-3-gathered weight alive until the backward (+80 MB a layer at 707M, TP=2 x "
               "DP=2; on a GPU the gathered weights are device memory); no upstream issue found; goes when "
               "DeepSpeed's forward saves the parameter. Also the vocabulary head's loss fused with its product: "
               "DeepSpeed's VocabParallelLinear only makes logits",
           test="tests/test_tensor_parallel.py::test_tp2_logits_loss_and_gradients_equal_the_unsharded_model",
           canaries=(("deepspeed.module_inject.layers", "torch.matmul(input, self.weight.transpose(-1, -2))"),))
def tp_forward_saving_the_parameter(layer, row_parallel: bool, linear: Callable[..., Any],
                                    product: Optional[Callable[[Any], Any]] = None,
                                    loss: Optional[Callable[..., Any]] = None):
    """A forward for one of DeepSpeed's TP layers (`LinearLayer`/`VocabParallelLinear`: column
    parallel; `LinearAllreduce`: row parallel) that multiplies through `linear` (`modules.linear.linear`)
    where DeepSpeed's multiplies by `self.weight.transpose(-1, -2)`. Same collectives (its
    autograd functions) and result; but autograd then saves the parameter, not a view of its
    data, so ZeRO-3 frees each gathered weight after the forward: DeepSpeed's view kept every
    layer's gathered weight alive until the backward (707M model, TP=2 x DP=2: +80 MB a layer).
    Only DeepSpeed's default path (no overlapped or compiler-deferred collectives), the one
    metaseq_ds runs; otherwise the layer's own forward is returned. (Checked on 2 ranks by
    tests/test_tensor_parallel.py: parity with the unsharded model, no saved view of a weight.)

    `product(input)`, for a column-parallel layer, replaces its local product (input @ Wᵀ + bias):
    the streamed tied embedding's (`distributed.tied_embedding`) never gathers W whole.

    `loss`, for the bias-free vocabulary head (`VocabParallelLinear`): the forward then also
    takes `target=` and `ignore_index=`, and given a target returns `loss(input (N, C), this
    rank's weight shard, target (N,), ignore_index, vocab_start, group)` instead of the logits
    (`modules.cross_entropy.vocab_parallel_linear_cross_entropy`, which sums the input's gradient
    over the group itself). It runs inside the module's call, where ZeRO-3's hooks gather W."""
    from deepspeed.module_inject import layers as tp

    if type(layer).tp_overlap_comm or layer.defer_collectives_to_compiler:
        if product is not None:
            raise NotImplementedError(
                "a streamed product under DeepSpeed's overlapped or compiler-deferred TP collectives")
        return layer.forward
    if product is None:
        def product(input):
            return linear(input, layer.weight, layer.bias)

    def row_forward(input):
        output = tp.RowParallel.apply(layer.mp_group, linear(input, layer.weight), not layer.is_training_mode())
        return output if layer.bias is None else output + layer.bias

    def column_forward(input):
        if layer.mp_group is not None:
            input = tp.ColumnParallel.apply(layer.mp_group, input)
        output = product(input)
        if layer.gather_output:
            output = tp.GatherFromTensorParallelRegion.apply(layer.mp_group, output, layer._partition_sizes)
        return output

    def head_forward(input, target=None, ignore_index: int = -100):
        if target is None:
            return column_forward(input)
        return loss(input.reshape(-1, input.size(-1)), layer.weight, target.reshape(-1), ignore_index,
                    layer.vocab_start_index, layer.mp_group)

    if row_parallel:
        return row_forward
    return column_forward if loss is None else head_forward


@relies_on("deepspeed", "module_inject.layers' VocabParallelEmbedding attributes and RowParallel",
           written_for="0.19", cuda=True,
           why="the streamed tied embedding (distributed.tied_embedding) looks up rows of its partition itself; "
               "DeepSpeed's layer has no hook for its local lookup",
           test="tests/test_tensor_parallel.py::test_tp2_dp2_zero3_on_4_ranks_follows_one_rank_then_resumes_resharded_at_tp1_and_exports")
def tp_vocab_embedding_forward(layer, lookup: Callable[[Any], Any]):
    """DeepSpeed's `VocabParallelEmbedding.forward` with its local lookup replaced by
    `lookup(rows)`: the rows of this rank's vocabulary shard, zeros for rows outside it (so no
    mask is needed). Same collective (its `RowParallel` sum over the tensor-parallel group) and
    scale. (Checked by tests/test_tensor_parallel.py: TP=2 x DP=2 under ZeRO-3, on 4 ranks,
    follows one rank's losses.)"""
    from deepspeed.module_inject import layers as tp

    def forward(input):
        output = lookup(input - layer.vocab_start_index)
        if layer.is_tp_parallel:
            output = tp.RowParallel.apply(layer.mp_group, output, not layer.is_training_mode())
        if layer.embed_scale is not None:
            output = output * layer.embed_scale.to(output.dtype)
        return output

    return forward
