"""The shape the codebase keeps (docs/ARCHITECTURE.md): small modules, small classes, a logger
instead of print() in the model core and the jobs. Each rule reads the source as it is, so a
change that breaks one fails here with the file and line."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 300


def _sources(*packages):
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def test_model_core_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in _sources("model_core")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines: {big}"


def test_model_core_classes_stay_small():
    big = []
    for p in _sources("model_core"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not big, f"classes over {MAX_CLASS_LINES} lines: {big}"


def _prints(path: Path, root: Path = ROOT) -> list[str]:
    return [f"{path.relative_to(root)}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"]


def test_no_print_in_model_core_tasks_or_app():
    found = [hit for p in _sources("model_core", "tasks", "app") for hit in _prints(p)]
    assert not found, f"print() where a module logger belongs: {found}"


@pytest.mark.parametrize("source, hits", [("print('x')\n", 1), ("log.info('x')\n", 0)])
def test_the_print_rule_can_fail(tmp_path, source, hits):
    f = tmp_path / "probe.py"
    f.write_text(source)
    assert len(_prints(f, tmp_path)) == hits


def test_every_trace_type_the_app_draws_keeps_the_page_template():
    """app/__init__.py keeps plotly_white's styling for the trace types in TRACE_TYPES only (a Figure
    validates the default template when made); a figure module drawing another type (go.Violin, or a
    dict trace {"type": "pie"}) would lose the page's look, so every type named in app/ is listed,
    each with plotly_white's own styling, and the default is that template."""
    import re

    import plotly.io as pio

    import app

    drawn = set()
    for path in (ROOT / "app").rglob("*.py"):
        text = path.read_text()
        drawn |= {m.lower() for m in re.findall(r"\bgo\.([A-Z][a-z]+)\(", text) if m != "Figure"}
        drawn |= set(re.findall(r'"type": "([a-z]+)"', text))
    assert {"bar", "heatmap", "scatter"} <= drawn  # the scan reads the figure modules
    assert drawn <= set(app.TRACE_TYPES), f"draw these with the page template: {sorted(drawn - set(app.TRACE_TYPES))}"
    assert pio.templates.default == "lmscope"
    kept, white = pio.templates["lmscope"], pio.templates["plotly_white"]
    assert kept.layout == white.layout
    assert all(kept.data[t] == white.data[t] for t in app.TRACE_TYPES)
