"""The one rename table: every target exists in metaseq_ds, the static resolver agrees with
real imports, the docs are generated from it, and reading it needs no torch."""

import importlib
import subprocess
import sys

import pytest

from metaseq_ds.renames import CLASS_RENAMES, MODULE_MOVES, NOT_PROVIDED, PACKAGE_RENAMES, new_module_path
from migrate import docs
from migrate.resolve import ModuleIndex, Translation, Unresolved


def test_the_table_holds_every_class_rename_of_metaseqs_history_once():
    old_names = [r.old_name for r in CLASS_RENAMES]
    assert len(old_names) == len(set(old_names)) == 21
    assert {"FairseqDecoder", "FairseqIncrementalDecoder", "DistributedFairseqModel", "FairseqDataclass"} <= set(old_names)


@pytest.mark.parametrize("rename", CLASS_RENAMES, ids=lambda r: r.old_name)
def test_every_class_target_resolves_by_import_and_statically(rename):
    module = importlib.import_module(rename.new_module)
    assert callable(getattr(module, rename.new_name))
    tr = ModuleIndex().translate(rename.old)
    assert isinstance(tr, Translation) and tr.dotted == rename.new


@pytest.mark.parametrize("old", sorted({**MODULE_MOVES, **PACKAGE_RENAMES}))
def test_every_module_target_is_a_module(old):
    new, _ = new_module_path(old)
    assert importlib.import_module(new).__name__ == new
    assert ModuleIndex().translate(old) == Translation(new, None, len(old.split(".")))


def test_the_static_index_reads_the_names_that_a_real_import_has():
    index = ModuleIndex()
    for module_name in ("metaseq_ds.models", "metaseq_ds.tasks", "metaseq_ds.logging.metrics", "metaseq_ds.optim.adam"):
        module = importlib.import_module(module_name)
        public = {n for n in vars(module) if not n.startswith("_") and not isinstance(vars(module)[n], type(sys))}
        assert public - index.names(module_name) <= {"annotations"}, module_name


@pytest.mark.parametrize("name", sorted(NOT_PROVIDED))
def test_what_is_left_out_on_purpose_is_absent_and_reported_with_its_reason(name):
    """An entry for a name that exists after all would hide it behind a stale reason."""
    for package in ("fairseq", "metaseq"):
        assert ModuleIndex().translate(f"{package}.{name}") == Unresolved(f"not provided: {NOT_PROVIDED[name]}")


def test_migration_doc_is_generated_from_the_table():
    assert docs.DOC_PATH.read_text() == docs.render(), "run: python -m migrate.docs --write"


def test_table_and_resolver_import_without_torch():
    code = ("import sys, metaseq_ds.renames, migrate.resolve, compat\n"
            "migrate.resolve.ModuleIndex().translate('fairseq.models.FairseqDecoder')\n"
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_lazily_importing_package_declares_its_names_for_readers_of_the_source():
    """metaseq_ds.data imports its names on first use; the resolver of `mseq migrate` (which reads
    the source, not the module) must still find every one of them."""
    import metaseq_ds.data as data
    from migrate.resolve import ModuleIndex

    assert sorted(data.__all__) == sorted(data._MODULE_OF)
    found = ModuleIndex().names("metaseq_ds.data")
    assert [name for name in data.__all__ if name not in found] == []
