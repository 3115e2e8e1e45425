"""Entry point for `lmscope serve`."""

from __future__ import annotations


def serve(host: str = "127.0.0.1", port: int = 7860, embedded_services: bool = True) -> None:
    import gradio as gr

    with gr.Blocks(title="lmscope") as demo:
        gr.Markdown("# lmscope\nThe explorer UI is being built; `lmscope trace` works from the command line.")
    demo.launch(server_name=host, server_port=port, show_error=True)
