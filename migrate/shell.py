"""`mseq migrate --shell`: command lines of fairseq's and metaseq's scripts in shell files.

    fairseq-train DATA --arch ...            ->  mseq train DATA --arch ...
    python -m metaseq.cli.train DATA ...     ->  mseq train DATA ...

Only commands that `mseq` has are rewritten (from `metaseq_ds.renames.COMMAND_RENAMES`); the
others (fairseq-preprocess, fairseq-generate, ...) are reported. Shell is not parsed: the
patterns are anchored on word boundaries, which is exact for command names.
"""

import re
from typing import List, Tuple

from metaseq_ds.renames import COMMAND_RENAMES
from migrate.codemod import FileResult, Item

SHELL_SUFFIXES = (".sh", ".bash")
_PYTHON_M = re.compile(r"\bpython[0-9.]*\s+-m\s+((?:fairseq_cli|metaseq_cli|metaseq\.cli)\.\w+)")
_SCRIPT = re.compile(r"(?<![\w./-])((?:fairseq|metaseq)-[a-z][a-z_-]*)")


def is_shell_script(path: str, head: str) -> bool:
    return path.endswith(SHELL_SUFFIXES) or bool(re.match(r"#!\S*/(?:env\s+)?(?:ba|z|da)?sh\b", head))


def migrate_shell(text: str, path: str) -> FileResult:
    result = FileResult(path)
    lines = text.splitlines(keepends=True)
    out: List[str] = []
    for number, line in enumerate(lines, start=1):
        edits: List[Tuple[int, int, str]] = []
        for pattern in (_PYTHON_M, _SCRIPT):
            for match in pattern.finditer(line):
                old = match.group(1)
                new = COMMAND_RENAMES.get(old)
                if any(start <= match.start() < end for start, end, _ in edits):
                    continue
                if new is None:
                    result.items.append(Item(path, number, match.start(), "command", old, "", "no mseq equivalent"))
                    continue
                edits.append((match.start(), match.end(), new))
                result.items.append(Item(path, number, match.start(), "shell", match.group(0), new, ""))
        for start, end, new in sorted(edits, reverse=True):
            line = line[:start] + new + line[end:]
        out.append(line)
    new_text = "".join(out)
    if new_text != text:
        result.new_code = new_text
    return result
