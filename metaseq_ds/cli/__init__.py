"""Command-line entry points (`mseq ...`); `metaseq_ds.cli.train` also runs under launchers."""
