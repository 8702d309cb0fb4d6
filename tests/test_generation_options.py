"""GenerationOptions: one check per bad value (one line naming the flag, keyword or field),
frozen, and the same object from `mseq generate`, GeneratorInterface's and SequenceGenerator's
keywords."""

import math

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

import metaseq_ds.cli.generate
import metaseq_ds.sequence_generator
from metaseq_ds.cli.main import app
from metaseq_ds.errors import UsageError
from metaseq_ds.generation_options import GenerationOptions, OptionError
from metaseq_ds.sequence_generator import SequenceGenerator
from test_sequence_generator import ByteTask, _scripted


def _flag(field):
    return "--" + field.replace("_", "-")


def _cli_args(values):
    args = []
    for field, value in values.items():
        if value is True:
            args.append(_flag(field))
        else:
            for item in value if isinstance(value, list) else [value]:
                args += [_flag(field), str(item)]
    return args


@pytest.fixture
def cli_options(monkeypatch):
    """Runs `mseq generate` with flags; returns the options it hands to generate.main."""
    seen = []
    monkeypatch.setattr(metaseq_ds.cli.generate, "main", lambda prompts, path, input_file, options, output_format, compile:
                        seen.append(options))

    def invoke(args):
        result = CliRunner().invoke(app, ["generate", "--path", "unused", "a prompt", *args])
        assert result.exit_code == 0, result.output
        return seen.pop()

    return invoke


@pytest.fixture
def interface_options(monkeypatch):
    """Runs GeneratorInterface.generate with keywords; returns the options of each SequenceGenerator."""
    built = []

    class Recording(SequenceGenerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.options)

    monkeypatch.setattr(metaseq_ds.sequence_generator, "SequenceGenerator", Recording)

    def generate(prompts=("Q:",), **keywords):
        _scripted("abc").generate(list(prompts), **keywords)
        options = list(built)
        built.clear()
        return options

    return generate


BAD = [
    ({"max_tokens": 0}, "{max_tokens} must be >= 1, got 0"),
    ({"min_tokens": -1}, "{min_tokens} must be >= 0, got -1"),
    ({"temperature": -0.5}, "{temperature} must be >= 0, got -0.5"),
    ({"temperature": math.nan}, "{temperature} must be a finite number >= 0, got nan"),
    ({"top_p": 1.5}, "{top_p} must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "{top_p} must be in (0, 1], got 0.0"),
    ({"top_k": -1}, "{top_k} must be >= 0, got -1"),
    ({"n": 0}, "{n} must be >= 1, got 0"),
    ({"best_of": 0}, "{best_of} must be >= 1, got 0"),
    ({"n": 3, "best_of": 2}, "need {n} <= {best_of}, got {n}=3, {best_of}=2"),
    ({"min_tokens": 5, "max_tokens": 4}, "need {min_tokens} <= {max_tokens}, got {min_tokens}=5, {max_tokens}=4"),
    ({"min_tokens": 40}, "need {min_tokens} <= {max_tokens}, got {min_tokens}=40, {max_tokens}=32"),
    ({"logprobs": -1}, "{logprobs} must be >= 0, got -1"),
    ({"seed": -1}, "{seed} must be in [0, 2**63), got -1"),
    ({"stop": [""]}, "{stop}: an empty stop string would stop at once"),
]
BAD_IDS = ["-".join(f"{k}={v}" for k, v in values.items()) for values, _ in BAD]


def _named(template, name):
    return template.format(**{field: name(field) for field in GenerationOptions.model_fields})


@pytest.mark.parametrize("values, complaint", BAD, ids=BAD_IDS)
def test_each_bad_value_is_one_line_naming_the_field(values, complaint):
    with pytest.raises(OptionError) as raised:
        GenerationOptions.from_values(values)
    assert str(raised.value) == _named(complaint, str)
    assert raised.value.field == next(iter(values))  # what an HTTP 400 reports as the parameter
    assert isinstance(raised.value, UsageError)


@pytest.mark.parametrize("values, complaint", BAD, ids=BAD_IDS)
def test_mseq_generate_names_the_flag_before_loading_anything(values, complaint):
    result = CliRunner().invoke(app, ["generate", "--path", "no-such-checkpoint", "a prompt", *_cli_args(values)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"mseq generate: error: {_named(complaint, _flag)}\n"


@pytest.mark.parametrize("values, complaint", BAD, ids=BAD_IDS)
def test_generator_interface_keywords_name_the_keyword(values, complaint):
    with pytest.raises(UsageError) as raised:
        _scripted("abc").generate(["Q:"], **values)
    assert str(raised.value) == _named(complaint, str)


@pytest.mark.parametrize(
    "keywords, complaint",
    [
        ({"topp": 1.5}, "topp must be in (0, 1], got 1.5"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"min_new_tokens": 3, "max_new_tokens": 2}, "need min_new_tokens <= max_new_tokens"),
        ({"beam_size": 0, "temperature": 0}, "beam_size must be >= 1, got 0"),
        ({"beam_size": 2, "temperature": 0.7}, "beam search is deterministic: use temperature 0"),
        ({"beam_size": 2}, "beam search is deterministic: use temperature 0"),
        ({"stop": [[]]}, "stop: an empty stop token sequence would stop at once"),
    ],
)
def test_sequence_generator_keywords_name_metaseqs_keyword(keywords, complaint):
    with pytest.raises(UsageError, match=complaint.replace("(", r"\(").replace("]", r"\]")):
        SequenceGenerator([object()], ByteTask.dictionary, **keywords)


def test_unknown_fields_are_refused_and_options_are_frozen_and_hashable():
    with pytest.raises(OptionError, match="^top_pp is not a generation option$"):
        GenerationOptions.from_values({"top_pp": 0.5})
    options = GenerationOptions(top_p=0.5)
    with pytest.raises(ValidationError, match="frozen"):
        options.top_p = 2.0
    assert options.top_p == 0.5
    assert {options: 1}[GenerationOptions(top_p=0.5)] == 1
    with pytest.raises(OptionError, match="max_tokens must be >= 1"):
        options.replace(max_tokens=0)  # copies are checked too
    assert options.replace(max_tokens=5) == GenerationOptions(top_p=0.5, max_tokens=5)


def test_one_default_per_field_on_every_path(cli_options, interface_options):
    defaults = GenerationOptions()
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.best_of) == (32, 1.0, 1.0, 1)
    assert cli_options([]) == defaults
    assert interface_options() == [defaults]
    assert SequenceGenerator([object()], ByteTask.dictionary).options == defaults
    assert SequenceGenerator([object()], ByteTask.dictionary, topp=-1.0).options == defaults  # metaseq's "off"


def test_cli_interface_and_generator_keywords_build_equal_options(cli_options, interface_options):
    beams = GenerationOptions(max_tokens=9, min_tokens=2, temperature=0, top_p=0.9, top_k=5, n=3, best_of=3,
                              logprobs=2, echo=True, seed=4, stop=["world."], length_penalty=0.5)
    same = dict(max_tokens=9, min_tokens=2, temperature=0, top_p=0.9, top_k=5, n=3, best_of=3, logprobs=2,
                echo=True, seed=4, stop=["world."], length_penalty=0.5)
    assert cli_options(_cli_args(same)) == beams
    assert interface_options(**same) == [beams]
    generator = SequenceGenerator([object()], ByteTask.dictionary, beam_size=3, max_new_tokens=9, min_new_tokens=2,
                                  temperature=0, topp=0.9, topk=5, need_logprobs=True, logprobs_topk=2, echo=True,
                                  seed=4, stop_strings=["world."], length_penalty=0.5, decode=ByteTask.tokenizer.decode)
    assert generator.options == beams

    samples = GenerationOptions(max_tokens=7, temperature=0.7, top_p=0.8, top_k=20, seed=1, stop=["a", "b"])
    same = dict(max_tokens=7, temperature=0.7, top_p=0.8, top_k=20, seed=1, stop=["a", "b"])
    assert cli_options(_cli_args(same)) == samples
    assert interface_options(**same) == [samples]
    assert SequenceGenerator([object()], ByteTask.dictionary, max_new_tokens=7, temperature=0.7, topp=0.8, topk=20,
                             seed=1, stop_strings=["a", "b"], decode=ByteTask.tokenizer.decode).options == samples


def test_options_object_and_keywords_complete_alike_but_not_together():
    interface = _scripted("Hello world. Bye")
    options = GenerationOptions(max_tokens=20, temperature=0, stop=["world."], logprobs=2)
    by_options = interface.generate(["Q:"], options=options)
    assert by_options == interface.generate(["Q:"], max_tokens=20, temperature=0, stop=["world."], logprobs=2)
    assert by_options[0][0]["text"] == "Hello "
    with pytest.raises(TypeError, match="not both"):
        interface.generate(["Q:"], temperature=0, options=options)
    with pytest.raises(TypeError, match="not both"):
        SequenceGenerator([object()], ByteTask.dictionary, options, topp=0.5)


def test_per_prompt_limits_are_checked_prompt_by_prompt(monkeypatch):
    limits = []
    decode = SequenceGenerator.generate

    def recording(self, models, sample, stream=None, *, min_tokens=None, max_tokens=None):
        limits.append(list(zip(min_tokens, max_tokens)))
        return decode(self, models, sample, stream, min_tokens=min_tokens, max_tokens=max_tokens)

    monkeypatch.setattr(SequenceGenerator, "generate", recording)
    _scripted("abc").generate(["a", "b", "c"], min_tokens=40, max_tokens=[50, 60, 50])
    assert limits == [[(40, 50), (40, 60), (40, 50)]]  # one batch, each prompt's own; not held to the default 32
    with pytest.raises(UsageError, match="^max_tokens must be >= 1, got 0$"):
        _scripted("abc").generate(["a", "b"], max_tokens=[3, 0])
    with pytest.raises(UsageError, match="^need min_tokens <= max_tokens, got min_tokens=5, max_tokens=4$"):
        _scripted("abc").generate(["a", "b"], min_tokens=[1, 5], max_tokens=4)
    with pytest.raises(UsageError, match="max_tokens: 1 values for 2 prompts"):
        _scripted("abc").generate(["a", "b"], max_tokens=[3])
