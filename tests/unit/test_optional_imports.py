"""app.server.main.mark_missing_optional_imports: Gradio's per-request optional imports of libraries that are
not installed fail at once instead of searching sys.path each time; installed ones are untouched."""

import importlib.util
import sys

import pytest

from app.server.main import mark_missing_optional_imports


def test_only_missing_libraries_are_marked_and_gradio_still_works():
    absent = "lmscope_no_such_library"
    sys.modules.pop(absent, None)
    was_marked = sys.modules.get("bokeh", 0) is None  # by a server this process built before
    if was_marked:
        del sys.modules["bokeh"]
    bokeh_installed = importlib.util.find_spec("bokeh") is not None
    marked = mark_missing_optional_imports(("plotly", absent, "bokeh"))
    try:
        assert marked == [absent] + ([] if bokeh_installed else ["bokeh"])  # plotly is installed: left alone
        assert sys.modules[absent] is None and importlib.util.find_spec(absent) is None
        with pytest.raises(ImportError):
            __import__(absent)
        import gradio as gr

        # Plot's config tries `import bokeh` on every request: with bokeh marked it still answers
        assert (gr.Plot().get_config()["bokeh_version"] is None) is not bokeh_installed
    finally:
        for name in marked:
            sys.modules.pop(name, None)
        if was_marked:
            sys.modules["bokeh"] = None
