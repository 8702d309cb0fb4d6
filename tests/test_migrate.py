"""`mseq migrate`: before/after pairs, one behaviour each, then the command's interface.

Every migrated output is checked with pyflakes: a rewrite must never introduce an undefined name.
"""

import json
import os
import textwrap

import pytest
from pyflakes.api import check as pyflakes_check
from pyflakes.reporter import Reporter
from typer.testing import CliRunner

from metaseq_ds.cli.main import app
from migrate.codemod import migrate_source
from migrate.resolve import ModuleIndex

INDEX = ModuleIndex()


def undefined_names(code: str):
    import io

    out = io.StringIO()
    pyflakes_check(code, "migrated.py", Reporter(out, out))
    return [line for line in out.getvalue().splitlines() if "undefined name '" in line]


def migrate(code: str):
    code = textwrap.dedent(code).lstrip("\n")
    result = migrate_source(code, "x.py", INDEX)
    out = result.new_code if result.new_code is not None else code
    assert undefined_names(out) == undefined_names(code), out
    assert migrate_source(out, "x.py", INDEX).new_code is None, "a second run must change nothing"
    return out, result.items


def kinds(items):
    return sorted({item.kind for item in items})


CASES = {
    "from_import_alias_keeps_the_alias": (
        "from fairseq.models import FairseqDecoder as D\nclass M(D): pass\n",
        "from metaseq_ds.models import BaseDecoder as D\nclass M(D): pass\n",
    ),
    "from_import_renames_every_use": (
        "from fairseq.tasks import FairseqTask\ndef f(t: FairseqTask):\n    return isinstance(t, FairseqTask)\n",
        "from metaseq_ds.tasks import BaseTask\ndef f(t: BaseTask):\n    return isinstance(t, BaseTask)\n",
    ),
    "import_as_module_renames_attributes": (
        "import fairseq.models as fm\nclass M(fm.FairseqDecoder): pass\nfm.register_model\n",
        "import metaseq_ds.models as fm\nclass M(fm.BaseDecoder): pass\nfm.register_model\n",
    ),
    "plain_import_imports_the_modules_its_uses_need": (
        "import fairseq\nclass T(fairseq.tasks.FairseqTask): pass\n",
        "import metaseq_ds.tasks\nclass T(metaseq_ds.tasks.BaseTask): pass\n",
    ),
    "try_import_except_importerror": (
        "try:\n    import fairseq\nexcept ImportError:\n    fairseq = None\nif fairseq is not None:\n    fairseq.models.BaseFairseqModel\n",
        "try:\n    import metaseq_ds.models\nexcept ImportError:\n    metaseq_ds = None\nif metaseq_ds is not None:\n    metaseq_ds.models.BaseModel\n",
    ),
    "comments_inside_multiline_imports_survive": (
        "from fairseq.models import (  # bases\n    FairseqEncoder,  # encoder\n    # the registry\n    register_model,\n)\nFairseqEncoder\n",
        "from metaseq_ds.models import (  # bases\n    BaseEncoder,  # encoder\n    # the registry\n    register_model,\n)\nBaseEncoder\n",
    ),
    "user_class_with_an_old_looking_name_stays": (
        "class FairseqLMState: pass\nclass FairseqDecoder: pass\nFairseqDecoder()\n",
        None,
    ),
    "relative_imports_stay": (
        "from .fairseq_decoder import FairseqDecoder\nfrom . import fairseq\n",
        None,
    ),
    "already_migrated_code_is_unchanged": (
        "from metaseq_ds.models import BaseDecoder\nimport metaseq_ds.tasks\nmetaseq_ds.tasks.BaseTask\n",
        None,
    ),
    "module_moves_follow_the_table": (
        "from fairseq import metrics\nfrom fairseq.models.fairseq_model import BaseFairseqModel\nmetrics.log_scalar('a', 1)\n",
        "from metaseq_ds.logging import metrics\nfrom metaseq_ds.models import BaseModel\nmetrics.log_scalar('a', 1)\n",
    ),
    "metaseq_layout_and_cli_package": (
        "from metaseq.models.base_decoder import BaseDecoder\nimport fairseq_cli.train\nfairseq_cli.train.cli_main\n",
        "from metaseq_ds.models import BaseDecoder\nimport metaseq_ds.cli.train\nmetaseq_ds.cli.train.cli_main\n",
    ),
    "all_lists_follow_the_rename": (
        "from fairseq.criterions import FairseqCriterion\n__all__ = ['FairseqCriterion']\n",
        "from metaseq_ds.criterions import BaseCriterion\n__all__ = ['BaseCriterion']\n",
    ),
    "a_name_already_taken_keeps_the_old_local_name": (
        "from fairseq.models import FairseqDecoder\nBaseDecoder = 1\nFairseqDecoder\n",
        "from metaseq_ds.models import BaseDecoder as FairseqDecoder\nBaseDecoder = 1\nFairseqDecoder\n",
    ),
    "star_import_renames_unbound_old_names": (
        "from fairseq.models import *\nclass D(FairseqDecoder): pass\n",
        "from metaseq_ds.models import *\nclass D(BaseDecoder): pass\n",
    ),
    "untouched_code_keeps_its_formatting": (
        "x   =  [ 1,2 ]  # odd spacing\nfrom fairseq.models import FairseqDecoder\ny =(FairseqDecoder ,x)\n",
        "x   =  [ 1,2 ]  # odd spacing\nfrom metaseq_ds.models import BaseDecoder\ny =(BaseDecoder ,x)\n",
    ),
    "metaseq_model_parallel_names_resolve": (
        "from metaseq.model_parallel.models.transformer_lm import ModelParallelTransformerLanguageModel\n"
        "from metaseq.distributed.utils import get_model_parallel_rank\n",
        "from metaseq_ds.model_parallel.models.transformer_lm import ModelParallelTransformerLanguageModel\n"
        "from metaseq_ds.distributed.utils import get_model_parallel_rank\n",
    ),
    "fairseq_architecture_functions_resolve": (
        "from fairseq.models.transformer_lm import base_lm_architecture, transformer_lm_gpt\n",
        "from metaseq_ds.models.transformer_lm import base_lm_architecture, transformer_lm_gpt\n",
    ),
    "utils_module_of_either_package": (
        "from fairseq import utils\nfrom metaseq import utils as mutils\nutils.item(x)\nmutils.set_torch_seed(1)\n",
        "from metaseq_ds import utils\nfrom metaseq_ds import utils as mutils\nutils.item(x)\nmutils.set_torch_seed(1)\n",
    ),
    "names_from_utils": (
        "from fairseq.utils import move_to_cuda, safe_hasattr\nimport metaseq.utils\nmetaseq.utils.strip_pad\n",
        "from metaseq_ds.utils import move_to_cuda, safe_hasattr\nimport metaseq_ds.utils\nmetaseq_ds.utils.strip_pad\n",
    ),
    "names_from_one_import_split_by_target_module": (
        "from fairseq.optim import FairseqOptimizer, FairseqAdam\n",
        "from metaseq_ds.optim import BaseOptimizer\nfrom metaseq_ds.optim.adam import MetaseqAdam\n",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_before_after(name):
    before, after = CASES[name]
    out, _ = migrate(before)
    assert out == (before if after is None else after)


def test_missing_target_is_left_and_reported():
    before = "from fairseq import utils\nfrom fairseq.models import FairseqDecoder, FairseqMultiModel\nutils.foo()\n"
    out, items = migrate(before)
    assert out == "from fairseq import utils\nfrom metaseq_ds.models import BaseDecoder\nfrom fairseq.models import FairseqMultiModel\nutils.foo()\n"
    unresolved = [(i.line, i.old) for i in items if i.kind == "unresolved"]
    assert unresolved == [(1, "fairseq.utils"), (2, "fairseq.models.FairseqMultiModel")]


def test_module_binding_with_a_missing_attribute_stays_whole():
    before = "import fairseq.distributed_utils as du\ndu.get_world_size()\ndu.get_rank()\n"
    out, items = migrate(before)
    assert out == before and kinds(items) == ["unresolved"]


def test_strings_naming_old_things_are_reported_not_rewritten():
    before = (
        'import subprocess, torch\n'
        'subprocess.run(["fairseq-train", "--user-dir", "p"])\n'
        'subprocess.run("python -m fairseq_cli.train data", shell=True)\n'
        'torch.hub.load("pytorch/fairseq", "transformer.wmt16.en-de")\n'
    )
    out, items = migrate(before)
    assert out == before
    strings = [(i.line, i.old, i.new) for i in items if i.kind == "string"]
    assert strings == [(2, "fairseq-train", "mseq train"), (2, "--user-dir", ""),
                       (3, "-m fairseq_cli.train", ""), (4, "pytorch/fairseq", "")]


def test_report_items_carry_position_and_names():
    _, items = migrate("import os\nfrom fairseq.models import FairseqDecoder as D\n")
    item = [i for i in items if i.kind == "import"][0]
    assert (item.line, item.col, item.old, item.new) == (2, 27, "fairseq.models.FairseqDecoder", "metaseq_ds.models.BaseDecoder")


# -- the command ----------------------------------------------------------------------------------
PLUGIN = "from fairseq.models import FairseqDecoder\nclass D(FairseqDecoder):\n    pass\n"


def mseq(*args):
    return CliRunner().invoke(app, ["migrate", *map(str, args)])


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.py").write_text(PLUGIN)
    (tmp_path / "pkg" / "clean.py").write_text("import os\n")
    for skipped in (".venv", "build", "site-packages"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "dep.py").write_text(PLUGIN)
    (tmp_path / "pkg" / "gen.py").write_text("# @generated by a tool\n" + PLUGIN)
    return tmp_path


def test_in_place_writes_only_changed_files_and_skips_default_excludes(tree):
    clean = tree / "pkg" / "clean.py"
    os.utime(clean, (1, 1))
    result = mseq(tree)
    assert result.exit_code == 0, result.output
    assert "from metaseq_ds.models import BaseDecoder" in (tree / "pkg" / "model.py").read_text()
    assert clean.stat().st_mtime == 1
    for untouched in (".venv/dep.py", "build/dep.py", "site-packages/dep.py", "pkg/gen.py"):
        assert "fairseq" in (tree / untouched).read_text(), untouched
    assert "3 files scanned, 1 changed, 1 imports rewritten, 1 renames" in result.output


def test_diff_prints_and_writes_nothing(tree):
    result = mseq(tree, "--diff")
    assert result.exit_code == 0
    assert "\n-from fairseq.models import FairseqDecoder\n" in result.output
    assert "\n+from metaseq_ds.models import BaseDecoder\n" in result.output
    assert (tree / "pkg" / "model.py").read_text() == PLUGIN


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_check_exits_1_while_work_remains(tree, jobs):
    assert mseq(tree, "--check", "-j", jobs).exit_code == 1
    assert (tree / "pkg" / "model.py").read_text() == PLUGIN
    assert mseq(tree, "-j", jobs).exit_code == 0
    assert mseq(tree, "--check", "-j", jobs).exit_code == 0


def test_exclude_glob(tree):
    mseq(tree, "--exclude", "model.py")
    assert (tree / "pkg" / "model.py").read_text() == PLUGIN


def test_syntax_error_is_reported_left_untouched_and_exits_3(tree):
    broken = tree / "pkg" / "broken.py"
    broken.write_text("from fairseq.models import FairseqDecoder\ndef f(:\n")
    result = mseq(tree, "--report", tree / "report.json")
    assert result.exit_code == 3
    assert broken.read_text() == "from fairseq.models import FairseqDecoder\ndef f(:\n"
    assert "BaseDecoder" in (tree / "pkg" / "model.py").read_text()  # the other files are migrated
    report = json.loads((tree / "report.json").read_text())
    failure = [r for r in report if r["kind"] == "failure"]
    assert failure[0]["file"].endswith("broken.py") and "syntax error" in failure[0]["reason"]
    assert set(report[0]) == {"file", "line", "col", "kind", "old", "new", "reason"}


def test_missing_path_is_a_usage_error(tmp_path):
    result = mseq(tmp_path / "nope")
    assert result.exit_code == 2
    assert result.output.strip() == f"mseq migrate: error: {tmp_path / 'nope'}: no such file or directory"


def test_shell_scripts_are_rewritten_with_shell(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text("fairseq-train data --arch x\npython -m metaseq.cli.train data\nfairseq-preprocess --only-source\n")
    assert mseq(tmp_path).exit_code == 0 and "fairseq-train" in script.read_text()  # not without --shell
    result = mseq(tmp_path, "--shell")
    assert result.exit_code == 0
    assert script.read_text() == "mseq train data --arch x\nmseq train data\nfairseq-preprocess --only-source\n"
    assert "command: fairseq-preprocess: no mseq equivalent" in result.output
