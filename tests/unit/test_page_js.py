"""The page's JavaScript lives in static/js/*.js (loaded by app.shared.page_js), not in Python strings.

Every file there must parse as JavaScript, with and without its placeholders filled in. The parser is
the pure-Python esprima (a dev dependency, so CI needs no Node). It reads ES2017: arrow functions,
template literals, spread, async; not optional chaining (`a?.b`) nor `??`, so the files are written
without them (`a && a.b`, `a !== undefined && a !== null ? a : b`).

And no module under app/ may hold JavaScript again: a scan of every string constant (docstrings
excepted: prose may name a `document.querySelector` call) for code-shaped text. Each check is also run
on a bad example, to show it can fail.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import esprima
import pytest

from app.shared.page_js import JS_DIR, PLACEHOLDER, page_js

ROOT = Path(__file__).resolve().parents[2]
JS_FILES = sorted(JS_DIR.glob("*.js"))

# What JavaScript in a Python string looks like: a block-bodied arrow or a function, the DOM, a
# <script> tag with code in it (app.shared.page_js.head_script wraps a file in an empty one), or a string that starts with an arrow function (`(f) => f`, `() => [...]`).
JS_SHAPES = [re.compile(p) for p in (r"=>\s*\{", r"\bfunction\s*\(", r"\bdocument\.\w", r"<script\b[^>]*>\s*[^<\s]",
                                     r"^\s*(\([^()]*\)|[A-Za-z_$][\w$]*)\s*=>")]


def js_errors(paths) -> list[str]:
    """'file: message' for each file that esprima cannot parse as a script."""
    errors = []
    for path in paths:
        try:
            esprima.parseScript(path.read_text(encoding="utf-8"))
        except esprima.Error as e:
            errors.append(f"{path.name}: {e}")
    return errors


def _docstrings(tree: ast.AST) -> set[int]:
    """id() of each docstring node: the first statement of a module, class or function, a string."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def js_in_python(source: str, name: str = "<string>") -> list[str]:
    """'name:line: text' for each string constant in `source` (docstrings aside) that looks like JS."""
    tree = ast.parse(source, name)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if any(p.search(node.value) for p in JS_SHAPES):
                found.append(f"{name}:{node.lineno}: {node.value[:60]!r}")
    return found


def test_the_parser_reads_the_syntax_the_files_use():
    for src in ["(...v) => { const [k, x] = v; return [...v]; }", "(s) => `a ${s} b`", "async () => { await 1; }",
                "const {a, ...rest} = {a: 1, b: 2};", "x => x.replace(/<br\\s*\\/?>/i, '')"]:
        esprima.parseScript(src)
    with pytest.raises(esprima.Error):  # why the files spell optional chaining out
        esprima.parseScript("a?.b")


def test_every_page_script_parses():
    assert len(JS_FILES) >= 17  # the page's scripts are here, not somewhere the glob misses
    assert js_errors(JS_FILES) == []


def test_every_page_script_parses_with_its_placeholders_filled():
    """Placeholders are identifiers or sit in string literals; filled with what the app passes, the code
    Gradio runs parses too."""
    samples = {"KEYS": repr(["model", "prompt"]), "DEFAULTS": '[0, "x", null]', "TAB": "explore",
               "FIRST_OPEN": "card,tree", "OP": "delete", "PANEL": "card"}
    for path in JS_FILES:
        names = {m[2:-2] for m in PLACEHOLDER.findall(path.read_text(encoding="utf-8"))}
        code = page_js(path.stem, **{k: samples[k] for k in names})
        assert not code.startswith("//") and not code.endswith("\n")  # only the code goes to Gradio
        esprima.parseScript(code)


def test_the_parse_check_fails_on_broken_javascript(tmp_path):
    bad = tmp_path / "bad.js"
    bad.write_text("() => { const q = ; }\n", encoding="utf-8")
    good = tmp_path / "good.js"
    good.write_text("// a comment\n() => [window.lmscopeOpenTab || '']\n", encoding="utf-8")
    assert js_errors([good]) == []
    assert [e.split(":")[0] for e in js_errors([good, bad])] == ["bad.js"]


def test_page_js_fills_placeholders_and_refuses_a_missing_or_extra_one():
    code = page_js("tab_url", TAB="jobs")
    assert "q.set('tab', 'jobs')" in code and "__" not in code
    with pytest.raises(KeyError):
        page_js("tab_url")
    with pytest.raises(KeyError):
        page_js("tab_url", TAB="jobs", PANEL="card")
    assert page_js("pass_value") == "(f) => f"


def test_no_python_module_under_app_holds_javascript():
    found = []
    for path in sorted((ROOT / "app").rglob("*.py")):
        found += js_in_python(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert found == [], "JavaScript belongs in static/js/ (app.shared.page_js):\n" + "\n".join(found)


def test_the_scan_finds_javascript_in_python():
    samples = ['X = """() => { return []; }"""', "f(js='(f) => f')", 'Y = "document.querySelector(\'#a\')"',
               'H = "<script>window.a = 1;</script>"', 'Z = "function(a) { return a; }"',
               'W = f"() => {{ q.set({1}) }}"']
    for src in samples:
        assert js_in_python(src), src
    prose = '"""Mirrors the view into the URL (a js-only load event: see document.querySelector)."""\n' \
            'X = "open it => the page shows"\nY = "the end of the document."\n'
    assert js_in_python(prose) == []
