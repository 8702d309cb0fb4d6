"""Errors that are the user's to fix.

Anything raised as `UsageError` reaches the user as one line and exit code 2, never as a
traceback: a bad flag, a missing data directory, a malformed jsonl line, a checkpoint of
another architecture. Bugs in metaseq_ds stay ordinary exceptions.
"""


class UsageError(Exception):
    """A mistake in the user's flags, files or data; the message says what would be right."""

    exit_code = 2
