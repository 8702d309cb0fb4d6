"""`mseq migrate`: a codemod from fairseq/metaseq code to metaseq_ds (libcst).

    mseq migrate my_plugin/ scripts/ --report migrate.json   # in place; only changed files written
    mseq migrate . --check                                   # CI: exit 1 if anything would change

`codemod` rewrites one Python source, `shell` command lines in shell scripts, `resolve` checks
targets against the installed metaseq_ds, `runner` walks trees and reports, and `docs`
generates docs/migration.md from the rename table (`metaseq_ds.renames`).
"""
