"""compat: old names are the new objects (with a warning), and the opt-in import hook."""

import subprocess
import sys
import warnings

import pytest

import compat
from metaseq_ds.errors import UsageError
from metaseq_ds.renames import CLASS_RENAMES


@pytest.fixture
def hook():
    compat.install()
    yield
    compat.uninstall()


@pytest.mark.parametrize("rename", CLASS_RENAMES, ids=lambda r: r.old_name)
def test_every_old_name_is_the_new_object_and_warns(rename):
    import importlib

    new = getattr(importlib.import_module(rename.new_module), rename.new_name)
    with pytest.warns(DeprecationWarning) as record:
        old = getattr(compat, rename.old_name)
    assert old is new
    message = str(record[0].message)
    assert rename.new in message and "mseq migrate" in message


def test_subclasses_of_old_names_are_instances_of_new_ones():
    from metaseq_ds.models import BaseDecoder

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from compat import FairseqIncrementalDecoder

    class Mine(FairseqIncrementalDecoder):
        pass

    assert issubclass(Mine, BaseDecoder) and isinstance(Mine(None), BaseDecoder)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="FairseqNothing"):
        compat.FairseqNothing


def test_hook_resolves_the_import_forms_of_plugin_code(hook):
    import metaseq_ds.cli.train
    import metaseq_ds.models
    from metaseq_ds.tasks import BaseTask

    with pytest.warns(DeprecationWarning, match="metaseq_ds.tasks.BaseTask"):
        from fairseq.tasks import FairseqTask
    assert FairseqTask is BaseTask
    import fairseq.models
    import fairseq_cli.train
    import metaseq.models
    from fairseq.models.fairseq_decoder import FairseqDecoder

    assert fairseq.models.register_model is metaseq_ds.models.register_model
    assert metaseq.models.BaseModel is metaseq_ds.models.BaseModel
    assert fairseq_cli.train.cli_main is metaseq_ds.cli.train.cli_main
    assert FairseqDecoder is metaseq_ds.models.BaseDecoder
    import fairseq.models.transformer_lm as tl

    assert tl.TransformerLanguageModel is metaseq_ds.models.TransformerLanguageModel


def test_hook_serves_the_utils_module_of_plugin_code(hook):
    import torch

    import metaseq_ds.utils
    from fairseq import utils
    from metaseq import utils as metaseq_utils

    assert utils.item(torch.tensor(3.0)) == 3.0
    assert metaseq_utils.set_torch_seed is metaseq_ds.utils.set_torch_seed


def test_hook_names_what_is_missing(hook):
    with pytest.raises(ModuleNotFoundError, match="fairseq.speech_recognition.*metaseq_ds.speech_recognition"):
        import fairseq.speech_recognition  # noqa: F401


def test_uninstall_forgets_the_aliases(hook):
    import fairseq.models  # noqa: F401

    compat.uninstall()
    assert not compat.installed() and not [m for m in sys.modules if m.startswith("fairseq")]
    with pytest.raises(ModuleNotFoundError):
        import fairseq  # noqa: F401
    compat.install()  # for the fixture's teardown


def test_refuses_to_shadow_a_real_fairseq_unless_forced(tmp_path, monkeypatch):
    (tmp_path / "fairseq").mkdir()
    (tmp_path / "fairseq" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"would shadow the installed fairseq .*force=True"):
        compat.install()
    assert not compat.installed()
    compat.install(force=True)
    try:
        import fairseq

        assert not hasattr(fairseq, "REAL") and fairseq.__compat_target__ == "metaseq_ds"
    finally:
        compat.uninstall()


def test_environment_variable_installs_the_hook(monkeypatch):
    monkeypatch.setenv(compat.ENV_VAR, "1")
    try:
        assert compat.install_from_env() and compat.installed()
    finally:
        compat.uninstall()
    monkeypatch.setenv(compat.ENV_VAR, "0")
    assert not compat.install_from_env() and not compat.installed()


def test_python_m_compat_runs_an_unedited_script(tmp_path):
    script = tmp_path / "old.py"
    script.write_text(
        "import sys\n"
        "from fairseq.models import FairseqDecoder\n"
        "from metaseq_ds.models import BaseDecoder\n"
        "assert FairseqDecoder is BaseDecoder\n"
        "print('ran with', sys.argv[1:])\n"
    )
    result = subprocess.run([sys.executable, "-m", "compat", str(script), "x"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ran with ['x']"
