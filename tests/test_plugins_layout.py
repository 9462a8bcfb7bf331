"""The plugins' package is laid out by kind, and docs/plugins.md's layout table says where each module is.

Lightning groups its own code by kind (``strategies/``, ``plugins/precision/``, ``plugins/io/``,
``plugins/environments/``); the plugins do the same, with a small top for the names users import. The table under
"Layout: a folder per kind" in docs/plugins.md is the map a reader follows, so it must name every module of every
subpackage, and no module that is gone: a module added or moved without the table fails here, naming the module
and the row. The modules stay small enough to hold one concept each: none over 500 lines.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "strategies" / "dalle_lightning_plugins"
DOC = ROOT / "docs" / "plugins.md"
HEADING = "### Layout: a folder per kind"
TOP = "(the top)"
KINDS = {"strategies", "precision", "compression", "io", "environments"}
MAX_LINES = 500
STRATEGY_MAX_LINES = 400  # the strategies/ subpackage (issue 74): a module a Lightning maintainer reads at one sitting


def _documented() -> dict[str, set[str]]:
    """The layout table's rows: subpackage (``TOP`` for the package itself) -> the module names its last column
    lists."""
    text = DOC.read_text()
    assert HEADING in text, f"docs/plugins.md has no heading {HEADING!r}; expected the plugins' layout table there"
    section = text.split(HEADING, 1)[1].split("\n#", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 3 or cells[0].startswith(("---", "`dalle_lightning_plugins.`")):
            continue
        kind = cells[0].strip("`")
        assert kind not in rows, f"docs/plugins.md's layout table has two rows for {kind!r}"
        rows[kind] = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cells[2]))
    return rows


def _tree() -> dict[str, set[str]]:
    """The package's folders as the table names them -> their modules (the top keeps ``__init__``, the names
    users import; a subpackage's ``__init__`` only says what the kind is)."""
    found = {TOP: {p.stem for p in PACKAGE.glob("*.py")}}
    for folder in sorted(p.parent for p in PACKAGE.glob("*/__init__.py")):
        found[folder.name] = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    return found


def test_the_package_has_a_subpackage_per_kind_and_nothing_deeper() -> None:
    tree = _tree()
    assert set(tree) - {TOP} == KINDS, f"subpackages {sorted(set(tree) - {TOP})}; expected {sorted(KINDS)}"
    deeper = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.glob("*/*/__init__.py"))
    assert not deeper, f"packages below a kind's folder: {deeper}; expected one level of subpackages"


def test_the_layout_table_in_docs_plugins_names_every_module_where_it_is() -> None:
    documented, tree = _documented(), _tree()
    assert set(documented) == set(tree), \
        f"docs/plugins.md's layout table has rows {sorted(documented)}; the package has {sorted(tree)}"
    for kind, modules in tree.items():
        missing, gone = sorted(modules - documented[kind]), sorted(documented[kind] - modules)
        assert not missing, f"docs/plugins.md's layout row {kind!r} lacks {missing}; add each with what it holds"
        assert not gone, f"docs/plugins.md's layout row {kind!r} names {gone}, which {kind!r} does not hold"


def test_no_plugin_module_is_over_500_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"plugin modules over {MAX_LINES} lines: {long}; expected one concept per module"


def test_no_strategy_module_is_over_400_lines() -> None:
    long = {p.name: n for p in sorted((PACKAGE / "strategies").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > STRATEGY_MAX_LINES}
    assert not long, f"strategies/ modules over {STRATEGY_MAX_LINES} lines: {long}; expected the hook order only"


def test_the_strategy_is_one_base_class_and_parts_that_keep_to_their_own_state() -> None:
    """No mixins (issue 70): every class in ``ShardedPowerSGDStrategy``'s MRO before Lightning's is a strategy, and no
    module of the plugins reads another object's private attribute through ``self.<part>._<name>``."""
    from lightning.pytorch.strategies import ParallelStrategy

    from dalle_lightning_plugins.strategies.local_steps import LocalStepsStrategy
    from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

    for strategy in (ShardedPowerSGDStrategy, LocalStepsStrategy):
        ours = [c for c in strategy.__mro__ if c.__module__.startswith("dalle_lightning_plugins")]
        assert all(issubclass(c, ParallelStrategy) for c in ours), ours
    reached = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            inner = getattr(node, "value", None)
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self"):
                reached.append(f"{path.relative_to(PACKAGE)}:{node.lineno} self.{inner.attr}.{node.attr}")
    assert not reached, reached


def test_the_strategy_calls_its_parts_and_hands_them_none_of_its_own() -> None:
    """A fit's flow is the strategy calling its parts (docs/plugins.md draws it): no part is handed one of the
    strategy's own methods (``self.<method>`` or ``super().<method>`` as an argument, which the part would call
    back), and no part's attribute is written from the strategy (``self.<part>.<name> = ...``)."""
    from dalle_lightning_plugins.strategies.local_steps import LocalStepsStrategy
    from dalle_lightning_plugins.strategies.parallel_base import ShardedParallelStrategy
    from dalle_lightning_plugins.strategies.sharded_powersgd import ShardedPowerSGDStrategy

    found = []
    for strategy in (ShardedParallelStrategy, ShardedPowerSGDStrategy, LocalStepsStrategy):
        path = Path(sys.modules[strategy.__module__].__file__)  # type: ignore[arg-type]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for arg in [*node.args, *(k.value for k in node.keywords)]:
                    if not isinstance(arg, ast.Attribute):
                        continue
                    own = isinstance(arg.value, ast.Name) and arg.value.id == "self" and callable(
                        getattr(strategy, arg.attr, None)) and not isinstance(getattr(strategy, arg.attr), property)
                    parent = isinstance(arg.value, ast.Call) and getattr(arg.value.func, "id", "") == "super"
                    if own or parent:
                        found.append(f"{path.name}:{node.lineno} hands {ast.unparse(arg)}")
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) else []:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)
                        and isinstance(target.value.value, ast.Name) and target.value.value.id == "self"):
                    found.append(f"{path.name}:{node.lineno} writes {ast.unparse(target)}")
    assert not found, found
