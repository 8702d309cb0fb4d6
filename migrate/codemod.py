"""Rewrite one Python source from fairseq/metaseq imports and names to metaseq_ds (libcst).

    result = migrate_source(code, "plugin/model.py", ModuleIndex())
    result.new_code  # None when nothing changes; result.items: what was done and what needs a person

Renames follow bindings, never text: each non-relative import of `fairseq`, `fairseq_cli`,
`metaseq` or `metaseq_cli` binds a local name (ScopeProvider), and only the uses of that
binding change. An import is rewritten only when its target, and every attribute the file
reads through it, exist in the installed metaseq_ds (`migrate.resolve`); otherwise it stays
and is reported. Untouched code keeps its exact text (libcst round-trips whitespace and
comments); strings naming old things are reported, never rewritten.
"""

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import (
    Assignment,
    BaseAssignment,
    GlobalScope,
    ImportAssignment,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    Scope,
    ScopeProvider,
)

from metaseq_ds.renames import COMMAND_RENAMES, class_rename, is_old_module
from migrate.resolve import ModuleIndex, Translation, Unresolved

# Kinds of report items. The first two are changes; the others need a person (docs/migration.md).
CHANGE_KINDS = ("import", "rename")
ATTENTION_KINDS = ("unresolved", "string", "star_import")


@dataclass
class Item:
    file: str
    line: int
    col: int
    kind: str
    old: str
    new: str
    reason: str

    def to_dict(self) -> Dict[str, Union[str, int]]:
        return dict(self.__dict__)


@dataclass
class FileResult:
    path: str
    new_code: Optional[str] = None  # the migrated text, only when it differs
    items: List[Item] = field(default_factory=list)
    failure: Optional[str] = None  # why the file was left untouched (syntax error, ...)
    skipped: bool = False  # an `@generated` file


# Without one of these words a file has nothing to migrate or report: it is not even parsed,
# which makes trees where few files use fairseq fast (parsing and scope analysis cost ~1 ms a line).
OLD_MENTION = re.compile(r"\b(?:fairseq|metaseq(?!_ds))|--user-dir")


def migrate_source(code: str, path: str, index: ModuleIndex) -> FileResult:
    result = FileResult(path)
    if not OLD_MENTION.search(code):
        return result
    try:
        module = cst.parse_module(code)
    except cst.ParserSyntaxError as error:
        result.failure = f"syntax error at line {error.raw_line}, column {error.raw_column}: {error.message}"
        result.items.append(Item(path, error.raw_line, error.raw_column, "failure", "", "", result.failure))
        return result
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    planner = _Planner(wrapper, path, index)
    planner.plan()
    result.items = sorted(planner.items, key=lambda item: (item.line, item.col))
    if not planner.expr_edits and not planner.import_edits:
        return result
    new_code = wrapper.module.visit(_Apply(planner.expr_edits, planner.import_edits)).code
    cst.parse_module(new_code)  # the output must parse; a failure here is a bug, reported by the runner
    if new_code != code:
        result.new_code = new_code
    return result


def dotted_expr(dotted: str) -> Union[cst.Name, cst.Attribute]:
    parts = dotted.split(".")
    node: Union[cst.Name, cst.Attribute] = cst.Name(parts[0])
    for part in parts[1:]:
        node = cst.Attribute(value=node, attr=cst.Name(part))
    return node


# Strings that name old command lines, hub entries or module paths: reported with what to do.
STRING_PATTERNS: Sequence[Tuple[re.Pattern, str]] = (
    (re.compile(r"\b(?:fairseq|metaseq)-[a-z][a-z_-]*"), "an old console script; `mseq migrate --shell` rewrites shell scripts"),
    (re.compile(r"-m\s+(?:fairseq_cli|metaseq_cli|metaseq\.cli)\.\w+"), "an old `python -m` entry point; `mseq migrate --shell` rewrites shell scripts"),
    (re.compile(r"pytorch/fairseq"), "a torch.hub entry of fairseq; metaseq_ds has no hub models"),
    (re.compile(r"--user-dir"), "a plugin directory: run `mseq migrate` on it (or compat.install())"),
    (re.compile(r"\b(?:fairseq_cli|metaseq_cli|fairseq|metaseq)(?:\.\w+)+"), "a module path in a string (import_module, config _target_, ...)"),
)


class _Planner:
    """First pass: decide every edit from the bindings of old imports, on the original tree."""

    def __init__(self, wrapper: MetadataWrapper, path: str, index: ModuleIndex):
        self.wrapper = wrapper
        self.path = path
        self.index = index
        metadata = wrapper.resolve_many([ScopeProvider, ParentNodeProvider, PositionProvider])  # one batched pass
        self.scopes = metadata[ScopeProvider]
        self.parents = metadata[ParentNodeProvider]
        self.positions = metadata[PositionProvider]
        self.expr_edits: Dict[cst.CSTNode, cst.CSTNode] = {}
        # import small statement -> its replacements (an empty list never happens: unresolved aliases stay)
        self.import_edits: Dict[cst.CSTNode, List[cst.BaseSmallStatement]] = {}
        self.items: List[Item] = []
        self.all_strings: List[cst.SimpleString] = []  # the names listed in a module-level `__all__`

    # -- reporting ---------------------------------------------------------------------------
    def _item(self, node: cst.CSTNode, kind: str, old: str, new: str, reason: str) -> None:
        start = self.positions[node].start
        self.items.append(Item(self.path, start.line, start.column, kind, old, new, reason))

    # -- driver ------------------------------------------------------------------------------
    def plan(self) -> None:
        imports: List[Union[cst.Import, cst.ImportFrom]] = []
        strings: List[cst.CSTNode] = []
        for node in self.positions:  # every node of the tree, in source order
            if isinstance(node, cst.Import) and any(is_old_module(get_full_name_for_node(a.name)) for a in node.names):
                imports.append(node)
            elif isinstance(node, cst.ImportFrom) and not node.relative and node.module is not None \
                    and is_old_module(get_full_name_for_node(node.module)):
                imports.append(node)
            elif isinstance(node, (cst.SimpleString, cst.FormattedStringText)):
                strings.append(node)
            elif isinstance(node, cst.Assign) and isinstance(self.scopes.get(node), GlobalScope) \
                    and any(get_full_name_for_node(t.target) == "__all__" for t in node.targets):
                self.all_strings.extend(n for n in _walk(node.value) if isinstance(n, cst.SimpleString))
        root_groups: Dict[Tuple[int, str], List[Tuple[cst.Import, cst.ImportAlias]]] = defaultdict(list)
        scope_of: Dict[int, Scope] = {}
        for node in imports:
            if isinstance(node, cst.ImportFrom):
                self._plan_import_from(node)
                continue
            for alias in node.names:
                name = get_full_name_for_node(alias.name)
                if not is_old_module(name):
                    continue
                if alias.asname is None:  # `import fairseq.models` binds `fairseq`: grouped per scope
                    scope = self.scopes[node]
                    scope_of[id(scope)] = scope
                    root_groups[(id(scope), name.split(".")[0])].append((node, alias))
        for (scope_id, root), aliases in root_groups.items():
            self._plan_root_binding(scope_of[scope_id], root, aliases)
        for node in imports:
            if isinstance(node, cst.Import):
                self._plan_import_aliases(node)
        for node in strings:
            self._check_string(node)

    # -- `from M import a as b` -----------------------------------------------------------
    def _plan_import_from(self, node: cst.ImportFrom) -> None:
        old_module = get_full_name_for_node(node.module)
        scope = self.scopes[node]
        if isinstance(node.names, cst.ImportStar):
            tr = self.index.translate(old_module)
            if isinstance(tr, Unresolved) or tr.attr is not None:
                self._item(node, "unresolved", f"{old_module}.*", "", getattr(tr, "reason", "not a module"))
                return
            self.import_edits[node] = [node.with_changes(module=dotted_expr(tr.module))]
            self._item(node, "import", f"{old_module}.*", f"{tr.module}.*", "star import")
            self._item(node, "star_import", f"{old_module}.*", f"{tr.module}.*",
                       "star import: names it provides are renamed where unbound; prefer explicit imports")
            self._rename_star_names(tr.module)
            return
        groups: Dict[Optional[str], List[cst.ImportAlias]] = {}  # new module (None: kept as is) -> aliases
        changed = False
        for alias in node.names:
            name = alias.name.value
            local = alias.asname.name.value if alias.asname else name
            old = f"{old_module}.{name}"
            tr = self.index.translate(old)
            new_alias = None
            if isinstance(tr, Translation):
                assignment = _assignment_of(scope, local, alias)
                if tr.attr is None:  # a module: every attribute read through it must exist
                    parent, _, last = tr.module.rpartition(".")
                    if self._plan_module_binding(assignment, old, tr.module, local):
                        new_alias = _alias(alias, last, local)
                        module_key = parent
                    else:
                        tr = Unresolved("attributes read through it are missing in metaseq_ds")
                else:
                    new_local = local
                    if alias.asname is None and tr.attr != name:
                        new_local = tr.attr if self._can_rename(assignment, tr.attr) else name
                        self._rename_binding(assignment, name, new_local)
                    new_alias = _alias(alias, tr.attr, new_local)
                    module_key = tr.module
            if new_alias is None:
                if isinstance(tr, Unresolved):
                    self._item(alias, "unresolved", old, "", tr.reason)
                groups.setdefault(None, []).append(alias)
                continue
            changed = True
            self._item(alias, "import", old, f"{module_key}.{new_alias.name.value}", "")
            groups.setdefault(module_key, []).append(new_alias)
        if not changed:
            return
        statements = []
        for module_key, aliases in groups.items():
            module_expr = node.module if module_key is None else dotted_expr(module_key)
            statements.append(node.with_changes(module=module_expr, names=_fix_commas(_dedupe(aliases), node)))
        self.import_edits[node] = statements

    # -- `import M as m` and the plain `import M` ------------------------------------------------
    def _plan_import_aliases(self, node: cst.Import) -> None:
        scope = self.scopes[node]
        new_aliases: List[cst.ImportAlias] = []
        changed = False
        for alias in node.names:
            name = get_full_name_for_node(alias.name)
            if not is_old_module(name):
                new_aliases.append(alias)
                continue
            if alias.asname is None:
                replacement = self.root_alias_edits.get(id(alias))
                if replacement is None:
                    new_aliases.append(alias)
                    continue
                new_aliases.extend(replacement)
                changed = True
                continue
            local = alias.asname.name.value
            tr = self.index.translate(name)
            if isinstance(tr, Translation) and tr.attr is None \
                    and self._plan_module_binding(_assignment_of(scope, local, alias), name, tr.module, local):
                new_aliases.append(alias.with_changes(name=dotted_expr(tr.module)))
                self._item(alias, "import", name, tr.module, "")
                changed = True
            else:
                reason = tr.reason if isinstance(tr, Unresolved) else "attributes read through it are missing in metaseq_ds"
                self._item(alias, "unresolved", name, "", reason)
                new_aliases.append(alias)
        if changed:
            self.import_edits[node] = [node.with_changes(names=_fix_commas(_dedupe(new_aliases), node))]

    @property
    def root_alias_edits(self) -> Dict[int, List[cst.ImportAlias]]:
        return self.__dict__.setdefault("_root_alias_edits", {})

    def _plan_root_binding(self, scope: Scope, root: str, aliases: List[Tuple[cst.Import, cst.ImportAlias]]) -> None:
        """`import fairseq[.x]` binds `fairseq`; every `fairseq.a.b` read in the scope must translate."""
        assignments = [a for a in scope.assignments if a.name == root or a.name.startswith(root + ".")]
        uses: Dict[int, cst.Name] = {}
        targets: List[cst.Name] = []
        for assignment in assignments:
            if isinstance(assignment, Assignment) and not isinstance(assignment, ImportAssignment):
                if isinstance(assignment.node, cst.Name):
                    targets.append(assignment.node)
                else:
                    return self._unresolved_all(aliases, f"`{root}` is also bound by other code here")
            elif isinstance(assignment, ImportAssignment) and not _plain_import_of(assignment.node, root):
                return self._unresolved_all(aliases, f"`{root}` is also bound by another import here")
            for access in assignment.references:
                name_node = _leftmost_name(access.node)
                if name_node is None:
                    return self._unresolved_all(aliases, f"`{root}` is used in a way that cannot be rewritten")
                uses[id(name_node)] = name_node
        root_tr = self.index.translate(root)
        if targets and (isinstance(root_tr, Unresolved) or "." in root_tr.dotted):
            return self._unresolved_all(aliases, f"`{root}` is assigned here and has no one-name equivalent")
        edits: Dict[cst.CSTNode, cst.CSTNode] = {}
        needed: List[str] = []
        for name_node in uses.values():
            chain = self._chain(name_node)
            old = ".".join(n.attr.value if isinstance(n, cst.Attribute) else n.value for n in chain)
            tr = self.index.translate(old)
            if isinstance(tr, Unresolved):
                return self._unresolved_all(aliases, f"{old}: {tr.reason}")
            edits[chain[tr.consumed - 1]] = dotted_expr(tr.dotted)
            needed.append(tr.module)
        own: List[Tuple[cst.ImportAlias, str]] = []
        for _, alias in aliases:
            tr = self.index.translate(get_full_name_for_node(alias.name))
            if isinstance(tr, Unresolved) or tr.attr is not None:
                reason = tr.reason if isinstance(tr, Unresolved) else "not a module"
                return self._unresolved_all(aliases, f"{get_full_name_for_node(alias.name)}: {reason}")
            own.append((alias, tr.module))
        new_root = own[0][1].split(".")[0]
        for target in targets:
            edits[target] = cst.Name(new_root)
        self.expr_edits.update(edits)
        # the first import also imports every module the uses need, so each `metaseq_ds.x.y` resolves
        modules = [own[0][1]] + sorted(set(needed))
        modules = [m for m in dict.fromkeys(modules) if not any(o != m and o.startswith(m + ".") for o in modules)]
        first_alias = own[0][0]
        self.root_alias_edits[id(first_alias)] = [first_alias.with_changes(name=dotted_expr(m)) for m in modules]
        self._item(first_alias, "import", get_full_name_for_node(first_alias.name), ", ".join(modules), "")
        for alias, module in own[1:]:
            self.root_alias_edits[id(alias)] = [alias.with_changes(name=dotted_expr(module))]
            self._item(alias, "import", get_full_name_for_node(alias.name), module, "")
        for node, new in edits.items():
            if isinstance(node, cst.Name) and node in targets:
                continue
            old_text = get_full_name_for_node(node) or ""
            if old_text != get_full_name_for_node(new):
                self._item(node, "rename", old_text, get_full_name_for_node(new), "")

    def _unresolved_all(self, aliases, reason: str) -> None:
        for _, alias in aliases:
            self._item(alias, "unresolved", get_full_name_for_node(alias.name), "", reason)

    # -- uses of a binding ------------------------------------------------------------------------
    def _plan_module_binding(self, assignment: Optional[BaseAssignment], old_module: str, new_module: str, local: str) -> bool:
        """Plan `local.x.y` -> `local.<new path>` for each read of a module binding; False if one is missing."""
        if assignment is None:
            return True
        edits: Dict[cst.CSTNode, cst.CSTNode] = {}
        for access in assignment.references:
            if not isinstance(access.node, cst.Name):
                return False
            chain = self._chain(access.node)
            if len(chain) == 1:
                continue
            rest = [n.attr.value for n in chain[1:]]
            tr = self.index.translate(".".join([old_module, *rest]))
            if isinstance(tr, Unresolved):
                return False
            if tr.dotted == new_module or tr.dotted.startswith(new_module + "."):
                relative = tr.dotted[len(new_module) + 1:]
            elif tr.attr is not None and self.index.has(new_module, tr.attr):
                relative = tr.attr  # a renamed class that the module re-exports
            else:
                return False
            consumed_node = chain[max(0, tr.consumed - old_module.count(".") - 1)]
            new = dotted_expr(".".join(filter(None, [local, relative])))
            if get_full_name_for_node(consumed_node) != get_full_name_for_node(new):
                edits[consumed_node] = new
        self.expr_edits.update(edits)
        for node, new in edits.items():
            self._item(node, "rename", get_full_name_for_node(node), get_full_name_for_node(new), "")
        return True

    def _can_rename(self, assignment: Optional[BaseAssignment], new_name: str) -> bool:
        """The new name may replace the local one unless it already means something where it is read."""
        if assignment is None:
            return True
        scopes = [assignment.scope] + [access.scope for access in assignment.references]
        return not any(
            a for scope in scopes for a in scope[new_name] if not (isinstance(a, ImportAssignment) and _is_old_import(a.node))
        )

    def _rename_binding(self, assignment: Optional[BaseAssignment], old: str, new: str) -> None:
        if assignment is None or old == new:
            return
        exported = self.all_strings if isinstance(assignment.scope, GlobalScope) else []
        for node in [access.node for access in assignment.references] + [s for s in exported if s.evaluated_value == old]:
            if isinstance(node, cst.Name):
                self.expr_edits[node] = cst.Name(new)
            elif isinstance(node, cst.SimpleString) and node.evaluated_value == old:  # `__all__ = ["Old"]`
                self.expr_edits[node] = node.with_changes(value=node.prefix + node.quote + new + node.quote)
            else:
                continue
            self._item(node, "rename", old, new, "")

    def _rename_star_names(self, new_module: str) -> None:
        """After `from fairseq.models import *`, unbound old class names in the file take their new names."""
        for any_scope in {s for s in self.scopes.values() if s is not None}:
            for access in any_scope.accesses:
                node = access.node
                if not isinstance(node, cst.Name) or access.referents:
                    continue
                rename = class_rename(node.value)
                if rename is not None and self.index.has(new_module, rename.new_name):
                    self.expr_edits[node] = cst.Name(rename.new_name)
                    self._item(node, "rename", node.value, rename.new_name, "name from a star import")

    def _chain(self, name: cst.Name) -> List[cst.CSTNode]:
        """`a` in `a.b.c`: [Name a, Attribute a.b, Attribute a.b.c] (as far as the dotted reads go)."""
        chain: List[cst.CSTNode] = [name]
        node = name
        while True:
            parent = self.parents.get(node)
            if not isinstance(parent, cst.Attribute) or parent.value is not node:
                return chain
            chain.append(parent)
            node = parent

    # -- strings ---------------------------------------------------------------------------------
    def _check_string(self, node: cst.CSTNode) -> None:
        parent = self.parents.get(node)
        if isinstance(node, cst.FormattedStringText):
            parent = self.parents.get(parent)
        if isinstance(parent, cst.Expr):
            return  # docstrings and bare string statements describe, they do not run
        text = node.value
        for pattern, reason in STRING_PATTERNS:
            match = pattern.search(text)
            if match:
                old = match.group(0)
                new = COMMAND_RENAMES.get(old, "")
                if not new and "." in old and is_old_module(old):
                    tr = self.index.translate(old)
                    new = tr.dotted if isinstance(tr, Translation) else ""
                self._item(node, "string", old, new, reason)
                return


class _Apply(cst.CSTTransformer):
    """Second pass: swap the planned nodes (matched by identity with the original tree)."""

    def __init__(self, expr_edits, import_edits):
        super().__init__()
        self.expr_edits = expr_edits
        self.import_edits = import_edits

    def on_leave(self, original_node, updated_node):
        if original_node in self.expr_edits:
            return self.expr_edits[original_node]
        return super().on_leave(original_node, updated_node)

    def leave_SimpleStatementLine(self, original_node, updated_node):
        body: List[cst.BaseSmallStatement] = []
        for original, updated in zip(original_node.body, updated_node.body):
            body.extend(self.import_edits.get(original, [updated]))
        if len(body) == len(updated_node.body):
            return updated_node.with_changes(body=body)
        if len(updated_node.body) == 1:  # one import became several: one line each
            return cst.FlattenSentinel(
                [updated_node.with_changes(body=[stmt], leading_lines=updated_node.leading_lines if i == 0 else [])
                 for i, stmt in enumerate(body)]
            )
        body = [stmt.with_changes(semicolon=cst.Semicolon(whitespace_after=cst.SimpleWhitespace(" "))) for stmt in body[:-1]] + [
            body[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]
        return updated_node.with_changes(body=body)


# -- helpers on import nodes -------------------------------------------------------------------
def _alias(alias: cst.ImportAlias, name: str, local: str) -> cst.ImportAlias:
    asname = None if local == name else cst.AsName(name=cst.Name(local))
    if alias.asname is not None and asname is not None:
        asname = alias.asname.with_changes(name=cst.Name(local))
    return alias.with_changes(name=cst.Name(name), asname=asname)


def _dedupe(aliases: List[cst.ImportAlias]) -> List[cst.ImportAlias]:
    seen: Set[Tuple[str, Optional[str]]] = set()
    out = []
    for alias in aliases:
        key = (get_full_name_for_node(alias.name), alias.asname.name.value if alias.asname else None)
        if key not in seen:
            seen.add(key)
            out.append(alias)
    return out


def _fix_commas(aliases: List[cst.ImportAlias], node: Union[cst.Import, cst.ImportFrom]) -> List[cst.ImportAlias]:
    """Every alias but the last needs a comma; the last keeps one only inside parentheses."""
    parenthesised = isinstance(node, cst.ImportFrom) and node.lpar is not None
    out = []
    for i, alias in enumerate(aliases):
        last = i == len(aliases) - 1
        if not last and isinstance(alias.comma, cst.MaybeSentinel):
            alias = alias.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        elif last and not parenthesised:
            alias = alias.with_changes(comma=cst.MaybeSentinel.DEFAULT)
        out.append(alias)
    return out


def _assignment_of(scope: Scope, local: str, alias: cst.ImportAlias) -> Optional[BaseAssignment]:
    for assignment in scope.assignments[local]:
        if isinstance(assignment, ImportAssignment) and any(a is alias for a in assignment.node.names):
            return assignment
    return None


def _plain_import_of(node: cst.CSTNode, root: str) -> bool:
    return isinstance(node, cst.Import) and any(
        a.asname is None and get_full_name_for_node(a.name).split(".")[0] == root for a in node.names
    )


def _is_old_import(node: cst.CSTNode) -> bool:
    if isinstance(node, cst.ImportFrom):
        return not node.relative and node.module is not None and is_old_module(get_full_name_for_node(node.module))
    return isinstance(node, cst.Import) and all(is_old_module(get_full_name_for_node(a.name)) for a in node.names)


def _walk(node: cst.CSTNode):
    yield node
    for child in node.children:
        yield from _walk(child)


def _leftmost_name(node: cst.CSTNode) -> Optional[cst.Name]:
    while isinstance(node, cst.Attribute):
        node = node.value
    return node if isinstance(node, cst.Name) else None
