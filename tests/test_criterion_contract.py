"""The criterion's sample size is the gradient's denominator: `mseq train` divides each update's
summed loss by the sum of `criterion.sample_size(sample)` over its micro-batches and ranks, logs
the loss per unit of it, and refuses a criterion whose forward returns another size."""

import textwrap

import pytest

from launch import TINY, log_records, run, write_corpus

PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass

    from metaseq_ds.criterions import register_criterion
    from metaseq_ds.criterions.cross_entropy import CrossEntropyCriterion
    from metaseq_ds.dataclass import MetaseqDataclass


    @dataclass
    class NoOptions(MetaseqDataclass):
        pass


    @register_criterion("per_sentence_cross_entropy", dataclass=NoOptions)
    class PerSentenceCrossEntropy(CrossEntropyCriterion):
        """Token losses summed per sentence: the gradient is divided by the number of sentences."""

        def sample_size(self, sample):
            return sample["nsentences"]


    @register_criterion("undeclared_sample_size", dataclass=NoOptions)
    class UndeclaredSampleSize(CrossEntropyCriterion):
        """Returns a per-sentence size from forward without declaring it: a plugin bug."""

        def forward(self, model, sample, reduce=True):
            loss, _, logging_output = super().forward(model, sample, reduce)
            return loss, sample["nsentences"], logging_output
''')

COMMON = [*TINY, "--max-update", "1", "--disable-validation", "--no-save", "--dropout", "0",
          "--batch-size", "4", "--optimizer", "sgd", "--clip-norm", "0"]


@pytest.fixture(scope="module")
def plugin_and_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    (root / "contract_plugin").mkdir()
    (root / "contract_plugin" / "__init__.py").write_text(PLUGIN)
    return root / "contract_plugin", write_corpus(root / "corpus")


def test_the_gradient_and_the_logged_loss_use_the_declared_sample_size(plugin_and_corpus, tmp_path):
    plugin, corpus = plugin_and_corpus
    per_token = log_records(run([str(corpus), *COMMON]).stdout)[0]
    per_sentence = log_records(run([str(corpus), *COMMON, "--user-dir", str(plugin), "--criterion",
                                    "per_sentence_cross_entropy"]).stdout)[0]
    tokens_per_sentence = per_token["wpb"] / per_token["bsz"]
    assert per_sentence["wpb"] == per_token["wpb"] and per_sentence["bsz"] == per_token["bsz"]  # same batch
    # Same weights and batch at update 1: dividing by sentences instead of tokens scales both.
    assert per_sentence["loss"] == pytest.approx(per_token["loss"] * tokens_per_sentence, rel=1e-4)
    assert per_sentence["gnorm"] == pytest.approx(per_token["gnorm"] * tokens_per_sentence, rel=1e-4)


def test_a_forward_that_returns_another_sample_size_is_refused_in_one_line(plugin_and_corpus, tmp_path):
    plugin, corpus = plugin_and_corpus
    result = run([str(corpus), *COMMON, "--user-dir", str(plugin), "--criterion", "undeclared_sample_size"],
                 check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "UndeclaredSampleSize: forward returned sample_size 4 but sample_size(sample) declared" in last
    assert "Traceback" not in result.stderr
