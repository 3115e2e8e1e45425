"""The page's JavaScript, kept in static/js/<name>.js rather than in Python strings.

Gradio runs a `js=` argument in the browser as a function expression, and `head=` as raw HTML; the
modules that wire events take those strings from `page_js(name)` (`head_script(name)` for the <head>).
A file holds one function expression (or, for the <head>, statements), so that an editor, a linter
and tests/unit/test_page_js.py can read it as JavaScript.

A file may start with `//` comment lines that say what it does and who loads it; `page_js` leaves
them out, and the final newline too, so that Gradio gets only the code.

Values that Python knows only when it builds the page (the URL keys of a tab, a panel's name) are
named in the file as placeholders `__NAME__` (capitals, digits and underscores between double
underscores, so that the file still parses) and given as keyword arguments: `page_js("tab_url",
TAB="explore")`. Each value is pasted in as written, so the caller formats it as the JavaScript it
stands for (a quoted string's contents, or a literal such as `repr(["a", "b"])`, which is also an
array in JavaScript). A placeholder without a value, or a value without its placeholder, is an error:
a typo fails when the page is built, not in the browser.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

JS_DIR = Path(__file__).resolve().parents[2] / "static" / "js"
PLACEHOLDER = re.compile(r"__[A-Z][A-Z0-9_]*__")


@functools.cache
def _source(name: str) -> str:
    """static/js/<name>.js without its leading `//` lines and its final newline (read once)."""
    lines = (JS_DIR / f"{name}.js").read_text(encoding="utf-8").split("\n")
    while lines and lines[0].startswith("//"):
        lines.pop(0)
    text = "\n".join(lines)
    return text[:-1] if text.endswith("\n") else text


def page_js(name: str, **values: str) -> str:
    """The code of static/js/<name>.js, each `__KEY__` placeholder replaced by values[KEY]."""
    text = _source(name)
    wanted = {m[2:-2] for m in PLACEHOLDER.findall(text)}
    if wanted != set(values):
        raise KeyError(f"static/js/{name}.js has placeholders {sorted(wanted)}, given {sorted(values)}")
    return PLACEHOLDER.sub(lambda m: values[m.group(0)[2:-2]], text)


def head_script(name: str, **values: str) -> str:
    """static/js/<name>.js as a <script> element, for Gradio's `head=` (HTML run before the app renders)."""
    return f"<script>{page_js(name, **values)}</script>"
