"""The output projection fused with the cross entropy (`modules.cross_entropy.linear_cross_entropy`,
`VocabularyProjection`, used by the `cross_entropy` criterion through `TransformerDecoder.output_loss`):
the losses and gradients of projecting then taking the cross entropy, without the (N, V) logits."""

import pytest
import torch

from metaseq_ds.criterions import CrossEntropyCriterionConfig, build_criterion
from metaseq_ds.modules import cross_entropy as cross_entropy_module
from metaseq_ds.modules.cross_entropy import VocabularyProjection, cross_entropy, linear_cross_entropy
from metaseq_ds.modules.linear import ROW_TILES
from test_hf_parity import PAD, TinyTask
from test_model import tiny_model, tokens


class Task(TinyTask):
    target_dictionary = TinyTask.dictionary


V, C, N = 40, 8, 13  # vocabulary, width, tokens


def problem(seed: int, pads):
    """(N, C) features, a (V, C) weight and (N,) targets, padding at `pads`."""
    generator = torch.Generator().manual_seed(seed)
    features, weight = torch.randn(N, C, generator=generator), torch.randn(V, C, generator=generator)
    target = torch.randint(0, V, (N,), generator=generator)
    target[pads] = PAD
    return features, weight, target


def projected_then_cross_entropy(features, weight, target):
    losses = cross_entropy(features @ weight.t(), target, ignore_index=PAD)
    return losses.sum(), losses


@pytest.mark.parametrize("row_tile", [1, 16])  # 16: the weight's gradient made in rows 0-31 and 32-39
@pytest.mark.parametrize("chunk_rows", [1, 3, 64])
def test_linear_cross_entropy_equals_the_projection_then_cross_entropy(chunk_rows, row_tile, monkeypatch):
    monkeypatch.setattr(cross_entropy_module, "CHUNK_ELEMENTS", chunk_rows * V)
    monkeypatch.setitem(ROW_TILES, ("cpu", torch.float32), row_tile)
    features, weight, target = problem(0, [2, 7])
    sums, grads = [], []
    for function in (linear_cross_entropy, projected_then_cross_entropy):
        x, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, losses = function(x, w, target) if function is projected_then_cross_entropy else function(x, w, target, PAD)
        (loss * 0.37).backward()  # a scale, as the trainer applies
        sums.append((loss, losses))
        grads.append((x.grad, w.grad))
    (loss, losses), (expected, expected_losses) = sums
    assert not losses.requires_grad and losses[2] == losses[7] == 0
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=1e-6)  # a sum of 13 losses near 4
    torch.testing.assert_close(losses, expected_losses.detach(), atol=1e-6, rtol=1e-6)
    for mine, reference in zip(*grads):
        torch.testing.assert_close(mine, reference, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("block_rows,chunk_rows,row_tile", [(40, 64, 1), (40, 64, 16), (7, 3, 1), (1, 13, 1)])
def test_blockwise_cross_entropy_over_blocks_of_rows_equals_linear_cross_entropy(block_rows, chunk_rows, row_tile,
                                                                                  monkeypatch):
    """W in blocks of `block_rows` rows (the streamed tied embedding's chunks), each block's logits
    a chunk of `chunk_rows` rows at a time (a block's gradient in parts of rows with `row_tile`
    16): the losses and gradients of the whole W's."""
    monkeypatch.setattr(cross_entropy_module, "CHUNK_ELEMENTS", chunk_rows * block_rows)
    monkeypatch.setitem(ROW_TILES, ("cpu", torch.float32), row_tile)
    features, weight, target = problem(1, [0, 9])
    x, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
    expected, expected_losses = linear_cross_entropy(x, w, target, PAD)
    expected.backward()
    blocks = [(first, weight[first:first + block_rows]) for first in range(0, V, block_rows)]
    loss_of = cross_entropy_module.BlockwiseCrossEntropy(features, target, PAD)
    for first, block in blocks:
        loss_of.add_block(first, block)
    losses = loss_of.losses()
    features_grad = torch.zeros(N, C)
    weight_grad = torch.cat([loss_of.gradient_block(first, block, features_grad) for first, block in blocks])
    assert losses[0] == losses[9] == 0
    torch.testing.assert_close(losses, expected_losses, atol=1e-6, rtol=1e-6)
    # 1e-6 of each gradient's largest element: 40 one-row blocks sum the features' in another order
    for mine, reference in ((features_grad, x.grad), (weight_grad, w.grad)):
        torch.testing.assert_close(mine, reference, atol=1e-6 * float(reference.abs().max()), rtol=0)


def test_without_gradients_only_the_losses_are_made():
    head = VocabularyProjection(8, 40)
    features, target = torch.randn(5, 8), torch.randint(0, 40, (5,))
    with torch.no_grad():
        loss, losses = head(features, target=target, ignore_index=PAD)
    reference = cross_entropy(head(features), target, ignore_index=PAD)
    torch.testing.assert_close(losses, reference)
    torch.testing.assert_close(loss, reference.sum())


@pytest.mark.parametrize("tied", [True, False])
def test_the_criterion_gives_the_losses_and_gradients_of_the_logits_path_without_the_logits(tied, monkeypatch):
    monkeypatch.setattr(cross_entropy_module, "CHUNK_ELEMENTS", 7 * len(TinyTask.dictionary))  # 7 rows a chunk
    fused, reference = (tiny_model(share_decoder_input_output_embed=tied) for _ in range(2))
    src = tokens(batch=3, length=10)
    target = tokens(batch=3, length=10, seed=2)
    target[2, 6:] = PAD
    sample = {"net_input": {"src_tokens": src}, "target": target, "ntokens": int(target.ne(PAD).sum())}
    criterion = build_criterion(CrossEntropyCriterionConfig(), Task())

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss, _, logging_output = criterion(fused, sample)
    (loss * 0.37).backward()
    # nothing the backward keeps is as large as the logits: (3 x 10) x vocabulary
    assert max(saved) < target.numel() * len(TinyTask.dictionary)

    logits = reference(src)[0]
    expected_losses = cross_entropy(logits.view(-1, logits.size(-1)), target.view(-1), ignore_index=PAD)
    (expected_losses.sum() * 0.37).backward()
    torch.testing.assert_close(loss, expected_losses.sum(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(logging_output["loss"], expected_losses.detach().double().sum(), atol=1e-6, rtol=1e-6)
    for (name, mine), theirs in zip(fused.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-6, msg=name)


def test_a_replaced_projection_forward_takes_the_logits_path():
    """ZeRO-3 streaming a tied embedding replaces the projection's forward: the loss is then
    taken from the logits that forward makes."""
    model = tiny_model()
    head = model.decoder.output_projection
    calls = []
    head.forward = lambda features: calls.append(features.shape) or torch.nn.functional.linear(features, head.weight)
    src, target = tokens(batch=2, length=6), tokens(batch=2, length=6, seed=2)
    loss, extra = model(src, target=target)
    assert calls == [torch.Size([2, 6, 16])]
    torch.testing.assert_close(loss, extra["token_losses"].sum())


def test_off_the_cpu_the_softmax_works_a_chunk_at_a_time_not_a_cache_sized_block():
    """A GPU pays ~6 kernel launches a block: OPT-1.3b's 8 x 2048 tokens over 50272 words take 25
    blocks there (on the meta device here), where the CPU's cache-sized blocks would be ~400."""
    rows, vocab = 8 * 2048, 50272
    assert len(list(cross_entropy_module._row_blocks(torch.empty(rows, vocab, device="meta")))) == 25
    cpu_rows = cross_entropy_module.BLOCK_ELEMENTS // vocab
    assert [b.stop for b in cross_entropy_module._row_blocks(torch.empty(2 * cpu_rows, vocab))] == [cpu_rows, 2 * cpu_rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blockwise_log_normalizers_and_gradient_equal_torchs_with_rows_of_minus_inf(monkeypatch, dtype):
    """In several blocks of one reused fp32 buffer (the last one part full): as torch.logsumexp,
    rows all -inf included, and the softmax gradient written over the logits."""
    monkeypatch.setattr(cross_entropy_module, "BLOCK_ELEMENTS", 4 * V)
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, V, generator=generator) * 5).to(dtype)
    logits[3] = -torch.inf
    logits[7, : V // 2] = -torch.inf
    expected = torch.logsumexp(logits.float(), dim=1)
    torch.testing.assert_close(cross_entropy_module._log_normalizers(logits), expected)

    target = torch.randint(0, V, (N, 1), generator=generator)
    keep = torch.ones(N, 1).index_fill_(0, torch.tensor([3]), 0.0)  # a row all -inf is a pad's
    softmax = torch.softmax(logits.float(), dim=1).nan_to_num_(0.0)
    gradient = (softmax * keep).scatter_add_(1, target, -keep)
    cross_entropy_module._into_gradient_(logits, expected.masked_fill(keep.squeeze(1) == 0, 0.0), target, keep)
    torch.testing.assert_close(logits.float(), gradient.to(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_pass_normalizers_and_gradient_equal_the_two_passes(monkeypatch, dtype):
    """The fused loss's one pass a block (the exponentials once, divided by their sum) gives the
    log-normalisers and the gradient of the two passes (exponentials of x - logsumexp), over
    several blocks of one reused buffer, rows all -inf (a pad's) and partly -inf included."""
    monkeypatch.setattr(cross_entropy_module, "BLOCK_ELEMENTS", 4 * V)
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(N, V, generator=generator) * 5).to(dtype)
    logits[3] = -torch.inf
    logits[7, : V // 2] = -torch.inf
    target = torch.randint(0, V, (N, 1), generator=generator)
    keep = torch.ones(N, 1).index_fill_(0, torch.tensor([3]), 0.0)

    two_passes = logits.clone()
    expected = cross_entropy_module._log_normalizers(two_passes)
    cross_entropy_module._into_gradient_(two_passes, expected.masked_fill(keep.squeeze(1) == 0, 0.0), target, keep)
    one_pass = logits.clone()
    log_normalizer = cross_entropy_module._normalizers_and_gradient_(one_pass, target, keep)
    torch.testing.assert_close(log_normalizer, expected, atol=1e-6, rtol=1e-6)
    assert bool(one_pass[3].eq(0).all())  # the pad's row: no gradient, not 0/0
    if dtype == torch.float32:
        torch.testing.assert_close(one_pass, two_passes, atol=1e-7, rtol=1e-6)
    else:  # each rounded once to bf16 from fp32 values equal within 1e-7: at most one bf16 step apart
        assert bool(((one_pass.float() - two_passes.float()).abs() <= two_passes.float().abs() * 2**-7 + 1e-30).all())
