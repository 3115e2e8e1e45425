"""lmscope's Gradio UI: layout in app/ui.py, callbacks in app/callbacks.py, figures in app/figures.py."""
