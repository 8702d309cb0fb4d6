"""Criterions: cross entropy against a manual computation, base-2 reporting, plugins."""

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

from metaseq_ds.criterions import (
    CRITERION_REGISTRY,
    BaseCriterion,
    CrossEntropyCriterion,
    CrossEntropyCriterionConfig,
    build_criterion,
    register_criterion,
)
from metaseq_ds.dataclass import MetaseqDataclass
from metaseq_ds.logging import metrics
from metaseq_ds.modules import cross_entropy as cross_entropy_module

PAD, VOCAB = 1, 11


class Dictionary:
    def pad(self):
        return PAD


class Task:
    target_dictionary = Dictionary()


class TinyLM(torch.nn.Module):
    """Returns (logits, extra) like metaseq's decoders."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.out = torch.nn.Linear(8, VOCAB)

    def forward(self, src_tokens):
        return self.out(self.embed(src_tokens)), {}


def make_sample():
    src = torch.tensor([[4, 5, 6, 7, 8], [4, 9, 10, PAD, PAD]])
    target = torch.tensor([[5, 6, 7, 8, 2], [9, 10, 2, PAD, PAD]])
    ntokens = int(target.ne(PAD).sum())
    return {"net_input": {"src_tokens": src}, "target": target, "ntokens": ntokens}


def manual_nll(model, sample):
    logits, _ = model(**sample["net_input"])
    lprobs = torch.log_softmax(logits.float(), dim=-1)
    target = sample["target"]
    picked = lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    return -(picked * target.ne(PAD)).sum()  # pads contribute nothing


def test_cross_entropy_matches_manual_sum_ignoring_padding():
    model, sample = TinyLM(), make_sample()
    criterion = build_criterion(CrossEntropyCriterionConfig(), Task())
    assert isinstance(criterion, CrossEntropyCriterion) and criterion.padding_idx == PAD
    loss, sample_size, logging_output = criterion(model, sample)
    torch.testing.assert_close(loss, manual_nll(model, sample))
    assert sample_size == sample["ntokens"] == 8
    assert logging_output["ntokens"] == 8 and logging_output["nsentences"] == 2 and logging_output["sample_size"] == 8
    assert not logging_output["loss"].requires_grad
    loss.backward()
    assert model.out.weight.grad is not None


def test_cross_entropy_unreduced_is_per_token_with_zero_at_pads():
    model, sample = TinyLM(), make_sample()
    criterion = build_criterion(CrossEntropyCriterionConfig(), Task())
    per_token, _, _ = criterion(model, sample, reduce=False)
    per_token = per_token.view(2, 5)
    assert (per_token[1, 3:] == 0).all() and (per_token[0] > 0).all()
    torch.testing.assert_close(per_token.sum(), manual_nll(model, sample))


def test_cross_entropy_upcasts_low_precision_logits():
    sample = make_sample()
    bf16_model = TinyLM().to(torch.bfloat16)
    criterion = build_criterion(CrossEntropyCriterionConfig(), Task())
    loss, _, _ = criterion(bf16_model, sample)
    assert loss.dtype == torch.float32
    reference = manual_nll(bf16_model, sample)  # manual_nll also takes log_softmax in fp32
    torch.testing.assert_close(loss, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_gradient_matches_torch(dtype, monkeypatch):
    """Blockwise softmax with the gradient written over the logits: same losses and parameter
    gradients as F.cross_entropy on fp32 logits, across block boundaries and with pads."""
    monkeypatch.setattr(cross_entropy_module, "BLOCK_ELEMENTS", 3 * VOCAB)  # 3 rows a block: 4 blocks
    sample = make_sample()
    ours, reference = TinyLM().to(dtype), TinyLM().to(dtype)
    criterion = build_criterion(CrossEntropyCriterionConfig(), Task())
    loss, _, _ = criterion(ours, sample)
    (loss * 0.37).backward()  # a scale, as the trainer applies
    expected = manual_nll(reference, sample)
    (expected * 0.37).backward()
    tolerance = {} if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(loss, expected)
    for mine, theirs in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, **tolerance)


def test_cross_entropy_without_gradient_leaves_the_logits_alone():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    target = torch.tensor([2, 5, PAD, 7, 0, 10])
    before = logits.clone()
    with torch.no_grad():
        losses = cross_entropy_module.cross_entropy(logits, target, ignore_index=PAD)
    assert torch.equal(logits, before)
    torch.testing.assert_close(losses, F.cross_entropy(logits, target, ignore_index=PAD, reduction="none"))


def test_reduce_metrics_reports_base_2_loss_and_ppl():
    model, sample = TinyLM(), make_sample()
    criterion = build_criterion(CrossEntropyCriterionConfig(), Task())
    outputs = [criterion(model, sample)[2], criterion(model, sample)[2]]  # e.g. two ranks
    nats = 2 * manual_nll(model, sample).item()
    with metrics.aggregate(new_root=True) as agg:
        CrossEntropyCriterion.reduce_metrics(outputs)
        values = agg.get_smoothed_values()
    bits = nats / 16 / math.log(2)
    assert values["loss"] == pytest.approx(bits, rel=1e-6)  # unrounded: the log line keeps 6 digits
    assert values["ppl"] == pytest.approx(2**bits, rel=1e-6)
    assert type(values["loss"]) is float and type(values["ppl"]) is float
    assert "nll_loss" not in values
    assert CrossEntropyCriterion.logging_outputs_can_be_summed()


def test_reduce_metrics_adds_nll_loss_when_sample_size_is_not_tokens():
    outputs = [{"loss": 20.0, "ntokens": 10, "nsentences": 2, "sample_size": 2}]
    with metrics.aggregate(new_root=True) as agg:
        CrossEntropyCriterion.reduce_metrics(outputs)
        values = agg.get_smoothed_values()
    assert values["loss"] == pytest.approx(10 / math.log(2))
    assert values["nll_loss"] == pytest.approx(2 / math.log(2))
    assert values["ppl"] == pytest.approx(2 ** (2 / math.log(2)))


@dataclass
class SmoothedConfig(MetaseqDataclass):
    label_smoothing: float = field(default=0.0, metadata={"help": "epsilon for label smoothing"})


@register_criterion("test_label_smoothed", dataclass=SmoothedConfig)
class LabelSmoothed(BaseCriterion):
    def __init__(self, task, label_smoothing, report_accuracy=False):
        super().__init__(task)
        self.eps = label_smoothing
        self.report_accuracy = report_accuracy

    def forward(self, model, sample, reduce=True):
        logits, _ = model(**sample["net_input"])
        loss = F.cross_entropy(
            logits.view(-1, VOCAB), sample["target"].view(-1), ignore_index=self.padding_idx,
            label_smoothing=self.eps, reduction="sum",
        )
        return loss, sample["ntokens"], {"loss": loss.detach()}


def test_plugin_criterion_gets_cfg_fields_by_name():
    criterion = build_criterion(SmoothedConfig(label_smoothing=0.1), Task())
    assert isinstance(criterion, LabelSmoothed)
    assert criterion.eps == 0.1 and criterion.report_accuracy is False and criterion.padding_idx == PAD
    smoothed, _, _ = criterion(TinyLM(), make_sample())
    assert not torch.isclose(smoothed, manual_nll(TinyLM(), make_sample()))  # the smoothing was applied


def test_unknown_init_argument_is_reported():
    class NeedsBeta(BaseCriterion):
        def __init__(self, task, beta):
            super().__init__(task)

    with pytest.raises(TypeError, match="'beta'"):
        NeedsBeta.build_criterion(SmoothedConfig(), Task())


def test_registry_has_cross_entropy():
    assert CRITERION_REGISTRY.get("cross_entropy").cls is CrossEntropyCriterion
    assert BaseCriterion(None).padding_idx == -100  # no task: torch's ignore index
