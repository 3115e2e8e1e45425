"""Entry point for `lmscope serve`: embedded services (Redis + worker) unless told otherwise,
then the Gradio app."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent / "static"


def serve(host: str = "127.0.0.1", port: int = 7860, embedded_services: bool = True) -> None:
    from model_core import paths

    services = None
    if embedded_services and importlib.util.find_spec("tasks.services") is not None:
        from tasks.services import ensure_services

        services = ensure_services(paths.data_dir())
    try:
        from app.ui import build_demo

        demo = build_demo()
        concurrency = int(os.environ.get("LMSCOPE_QUEUE_CONCURRENCY", "2"))
        demo.queue(default_concurrency_limit=concurrency, max_size=int(os.environ.get("LMSCOPE_QUEUE_MAX", "64")))
        print(f"lmscope: serving on http://{host}:{port}", flush=True)
        demo.launch(server_name=host, server_port=port, show_error=True, css_paths=[str(STATIC / "lmscope.css")],
                    footer_links=["api"], quiet=True)
    finally:
        if services is not None:
            services.stop()
