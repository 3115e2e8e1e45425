"""Entry point for `lmscope serve`: embedded services (Redis + worker) unless told otherwise,
then the Gradio app mounted on a FastAPI app that also answers the operator's endpoints:

  GET /healthz  -> 200 {"status": "ok"}, or {"status": "degraded", "down": {...}} when the job queue or
                   every job worker is down; public (for load balancers and compose health checks).
  GET /static/fonts/<file> -> a webfont of static/fonts/ (a name the folder holds, no listing); public, as
                   the page's CSS asks for it before anyone signs in.
  GET /metrics  -> JSON: job queue length, jobs by state, loaded models and their devices, GPU memory,
                   trace cache size. With sign-in on it needs `Authorization: Bearer <token>`
                   (LMSCOPE_AUTH_TOKEN, or `user:password` of a users-file user).

Configuration: model_core.core.settings.Settings (environment variables; see that module's table), read
once by app/server/cli.py and passed to serve().
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from pathlib import Path

from fastapi import Request  # module level: FastAPI resolves the route's annotation by name

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parents[2] / "static"
FONT_TYPES = {".woff2": "font/woff2", ".txt": "text/plain; charset=utf-8"}  # the fonts and their licence
STARTED = time.time()


def metrics(settings) -> dict:
    """What an operator needs to see at a glance; every part degrades to an 'error' field."""
    out: dict = {"uptime_s": round(time.time() - STARTED, 1), "auth": settings.auth}
    try:
        from tasks import celery_app, store

        r = store.probe_client(timeout=1.0)
        try:
            out["jobs"] = {"redis": "ok", **store.overview(r, queue=celery_app.QUEUE)}
        finally:
            r.close()
    except Exception as e:  # noqa: BLE001 - the operator wants to see that Redis is down, not a 500
        out["jobs"] = {"redis": "unreachable", "error": str(e).splitlines()[0] if str(e) else type(e).__name__}
    try:
        from model_core.core import registry
        from model_core.interp.trace_batching import stats_for
        from model_core.serving.engine import existing_engine

        def engine_stats(lm):
            eng = existing_engine(lm)
            return eng.stats_dict() if eng is not None else None

        out["models"] = [{"name": lm.name, "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""),
                          "source": lm.source, "load_seconds": round(lm.load_seconds, 2), "batching": stats_for(lm),
                          "engine": engine_stats(lm)}
                         for lm in registry.loaded_models()]
    except Exception as e:  # noqa: BLE001
        out["models"] = {"error": str(e)}
    client = model_process()
    if client is not None:
        out["model_processes"] = [model_process_health(client)]
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = [{"index": i, "name": torch.cuda.get_device_name(i),
                           "allocated_bytes": torch.cuda.memory_allocated(i),
                           "reserved_bytes": torch.cuda.memory_reserved(i),
                           "total_bytes": torch.cuda.get_device_properties(i).total_memory}
                          for i in range(torch.cuda.device_count())]
        else:
            out["gpu"] = []
    except Exception as e:  # noqa: BLE001
        out["gpu"] = {"error": str(e)}
    try:
        from app.shared.trace_store import STORE

        out["trace_cache"] = {"items": len(STORE), "max_items": STORE.max_items}
    except Exception as e:  # noqa: BLE001
        out["trace_cache"] = {"error": str(e)}
    return out


def model_process():
    from app.shared.context import model_process as current

    return current()


def model_process_health(client) -> dict:
    """The client's view of its model process (pid, device, state and since when), the pid the
    supervisor started where it runs here, and `since` as a time a person reads."""
    h = client.health()
    proc = getattr(_services, "model_proc", None)
    if proc is not None:
        h["pid"] = proc.pid if proc.poll() is None else h["pid"]
    h["since_text"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(h["since"]))
    return h


_services = None  # serve()'s ServicesHandle, for the model process's pid


# Gradio tries these optional imports on every request (Plot's config, the matplotlib backend
# guard); absent, each try searches sys.path again: 33 us, ~1,000 times in one streamed
# generation's updates, ~12 % of the web side's interpreter time (docs/PERFORMANCE.md).
OPTIONAL_PLOT_LIBRARIES = ("bokeh", "matplotlib")


def mark_missing_optional_imports(names=OPTIONAL_PLOT_LIBRARIES) -> list[str]:
    """Record the ones not installed as missing in sys.modules (an import of such a name raises
    ImportError at once, as it would have after the search). Returns those marked."""
    missing = [n for n in names if n not in sys.modules and importlib.util.find_spec(n) is None]
    for n in missing:
        sys.modules[n] = None
    return missing


def build_app(settings=None):
    """The FastAPI app: /healthz, /metrics and the Gradio UI at /. Returns (app, demo)."""
    mark_missing_optional_imports()
    import gradio as gr

    from app.server import gradio_tuning

    gradio_tuning.skip_unchanged_outputs()  # a skipped output costs Gradio a component rebuild otherwise
    gradio_tuning.lazy_session_configs()  # a new session costs Gradio every component's config otherwise
    from fastapi import FastAPI
    from fastapi.responses import FileResponse, JSONResponse
    from starlette.background import BackgroundTask
    from starlette.routing import Mount

    from app.server import auth
    from app.server.api import limit_queue_share
    from app.server.page import HEAD_JS, build_demo
    from model_core.core.settings import Settings

    settings = settings or Settings.from_env()
    api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    auth.install_login_throttle(api, settings)  # failed sign-ins on POST /login: 429 after a few

    health_clients: dict = {}  # one short-timeout client per broker URL

    @api.get("/healthz")
    def healthz():
        """{"status": "ok"} when the job queue answers a ping and at least one job worker's heartbeat
        is live; else {"status": "degraded", "down": {part: one sentence}}. Still HTTP 200 either
        way: this web app itself is up and serving, which is what a load balancer asks. Fast: 0.5 s
        timeouts, no retries. The sentences name no URL, password or path."""
        from tasks import config, store

        url = config.redis_url()
        r = health_clients.get(url)
        if r is None:
            r = health_clients[url] = store.probe_client(url, timeout=0.5)
        down = {}
        try:
            r.ping()
        except Exception:  # noqa: BLE001 - any failure means jobs cannot be queued
            down["broker"] = "The job queue (Redis) does not answer, so jobs can be neither queued nor run."
        else:
            try:
                if store.live_workers(r) == 0:
                    down["worker"] = (f"No job worker has sent a heartbeat in the last {config.WORKER_BEAT_TTL_S} s, "
                                      "so queued jobs wait.")
            except Exception:  # noqa: BLE001
                down["broker"] = "The job queue (Redis) stopped answering while the workers were counted."
        out = {"status": "degraded", "down": down} if down else {"status": "ok"}
        client = model_process()
        if client is not None:
            h = model_process_health(client)
            out["model_processes"] = [h]
            if h["state"] != "ready":
                out["status"] = "degraded"
                out.setdefault("down", {})["model_process"] = (
                    f"The model process is {h['state']} (since {h['since_text']}), so generations wait for it.")
        return out

    # The files static/fonts.css names (issue 37 item 11), looked up by name in what the folder held at
    # start: a name is never joined onto a path, so nothing outside it (nor a listing) can be asked for.
    # Before the mount: Gradio's own /static/{path} would take the path otherwise.
    fonts = {p.name: p for p in sorted((STATIC / "fonts").glob("*")) if p.suffix in FONT_TYPES and p.is_file()}

    @api.get("/static/fonts/{name}")
    def font_file(name: str):
        path = fonts.get(name)
        if path is None:
            return JSONResponse({"error": "No such file."}, status_code=404)
        return FileResponse(path, media_type=FONT_TYPES[path.suffix],
                            headers={"Cache-Control": "public, max-age=604800"})

    @api.get("/metrics")
    def metrics_route(request: Request):
        if not auth.bearer_ok(settings, request.headers.get("authorization"),
                              request.client.host if request.client else None):
            return JSONResponse({"error": "Send Authorization: Bearer <LMSCOPE_AUTH_TOKEN>."}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        return metrics(settings)

    @api.get("/download/model/{name}.zip")  # before /download/{job_id}/{name}, which would take it
    def download_model(name: str, request: Request):
        """A fine-tuned model as a Hugging Face folder in a zip, with a model card. Fine-tuned models
        are shared by design, so any signed-in user (anyone with sign-in off) may take any of them;
        `name` must be one the registry lists as fine-tuned (never joined onto a path otherwise)."""
        gradio_app = next(r.app for r in api.routes if isinstance(r, Mount))
        if settings.auth_on and session_user(gradio_app, request) is None:
            return JSONResponse({"error": "Sign in first."}, status_code=401)
        built = model_zip(name)
        if built is None:
            return JSONResponse({"error": "No such fine-tuned model."}, status_code=404)
        return FileResponse(built, filename=f"{name}.zip", media_type="application/zip",
                            background=BackgroundTask(os.unlink, built))

    @api.get("/download/{job_id}/{name}")  # before the mount: Gradio's mount at "" takes every path
    def download(job_id: str, name: str, request: Request):
        """A job's artifact, for its owner only (anyone with sign-in off): 404 for someone else's
        job, as for a job that does not exist, so ids are not revealed."""
        gradio_app = next(r.app for r in api.routes if isinstance(r, Mount))
        user = session_user(gradio_app, request)
        if settings.auth_on and user is None:
            return JSONResponse({"error": "Sign in first."}, status_code=401)
        path = artifact_file(job_id, name, user if settings.auth_on else None)
        if path is None:
            return JSONResponse({"error": "No such file."}, status_code=404)
        return FileResponse(path, filename=f"{job_id}-{name}")

    demo = build_demo()
    demo.queue(default_concurrency_limit=settings.queue_concurrency, max_size=settings.queue_max)
    limit_queue_share(demo, queue_share(settings))
    gradio_tuning.poll_queue_every(demo)  # not every 1 ms: the engine thread needs the interpreter
    gradio_tuning.no_event_summaries(demo)  # not a DataFrame of 10,000 events after each one
    app = gr.mount_gradio_app(
        api, demo, path="", auth=auth.async_authenticator(settings),
        auth_message="Sign in to lmscope." if settings.auth_on else None,
        show_error=True, css_paths=[str(p) for p in sorted(STATIC.glob("*.css"))], footer_links=["api"], head=HEAD_JS,
        max_file_size=int(settings.upload_max_mb * 1024 * 1024),
        enable_monitoring=False,  # /metrics is lmscope's; Gradio's summary of events is not kept up
    )
    # a page load costs Gradio a copy of the whole config otherwise
    gradio_tuning.cache_page_config(next(r.app for r in app.routes if isinstance(r, Mount)))
    # Gradio checks that an input file came through its upload route only once the app "has
    # launched"; a mounted app never launches, so without this any server path a request names
    # would be copied into the cache and handed to the callback.
    demo.has_launched = True
    return app, demo


def queue_share(settings) -> int:
    """Places in the shared queue one user may hold: a quarter of it, and never fewer than the
    panels one page fires at once."""
    return max(8, settings.queue_max // 4)


def session_user(gradio_app, request) -> str | None:
    """The signed-in user of a plain FastAPI request, read from Gradio's session cookie exactly as
    Gradio's own /user route does."""
    cookies = request.cookies
    token = (cookies.get(f"access-token-{gradio_app.cookie_id}")
             or cookies.get(f"access-token-unsecure-{gradio_app.cookie_id}"))
    return gradio_app.tokens.get(token) if token else None


def artifact_file(job_id: str, name: str, owner: str | None) -> Path | None:
    """The artifact `name` of job `job_id` when `owner` (None: anyone) may read it; tasks.jobs
    .artifact_path only returns files inside the job's own folder."""
    from model_core.core.errors import LmscopeError
    from tasks import jobs

    try:
        return jobs.artifact_path(jobs.get_job(job_id, owner), name)
    except LmscopeError:
        return None


def model_zip(name: str) -> str | None:
    """Build the download zip of the fine-tuned model `name` into a temporary file (the caller
    deletes it) and return its path; None unless `name` is a registered fine-tuned model."""
    import json
    import tempfile

    from model_core.core import paths
    from model_core.core.registry import list_models
    from model_core.training import export

    known = {r["name"] for r in list_models(include_random=False) if r["source"] == "finetuned"}
    if name not in known:
        return None
    d = paths.finetuned_dir() / name
    try:
        meta = json.loads((d / "lmscope.json").read_text())
    except (OSError, ValueError):
        meta = {}
    fd, tmp = tempfile.mkstemp(prefix="lmscope-model-", suffix=".zip")
    try:
        with os.fdopen(fd, "wb") as f:
            export.write_model_zip(d, f, export.model_card(meta, name), folder=name)
    except (OSError, ValueError):  # removed or overwritten while zipping, or no weights
        os.unlink(tmp)
        return None
    return tmp


def start_model_process(settings, services) -> bool:
    """LMSCOPE_MODEL_PROCESS: "on" (and "auto" where models load on CUDA) starts a supervised model
    process on this host, an address connects to one started elsewhere; either way generations go
    there from now on. Returns whether generations stay in this process ("off", "auto" on a CPU)."""
    if settings.model_process == "off" or (settings.model_process == "auto" and not _on_cuda(settings)):
        return True
    from app.shared.context import use_model_process
    from model_core.core import paths
    from model_core.serving.model_process_client import ModelProcessClient
    from model_core.serving.model_process_wire import shared_key

    global _services
    address = settings.model_process
    if address in ("on", "auto"):
        from tasks.services import ensure_model_process

        address, _services = ensure_model_process(paths.data_dir(), services)
        log.info("%s", _services.notes[-1])
    use_model_process(ModelProcessClient(address, shared_key(paths.data_dir(), settings.model_process_key)))
    return False


def _on_cuda(settings) -> bool:
    """Whether models load on CUDA here (LMSCOPE_DEVICE cuda, cuda:N or auto, or unset on a CUDA host)."""
    if settings.device not in (None, "auto"):
        return settings.device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def _preload(name: str, device: str | None = None, dtype: str | None = None, engine: bool = True) -> None:
    """Load the default model and start its engine in the background while the server starts, so the
    first visitor does not pay the ~2 s of importing transformers' model code and reading the
    weights, nor its first generations the engine's recordings (model_core.serving.torchscript_replay)."""
    import threading

    with_engine = engine

    def load():
        from model_core import load_model
        from model_core.core.errors import LmscopeError
        from model_core.serving import engine

        try:
            lm = load_model(name, device=device, dtype=dtype, allow_paths=False, allow_hub=False)
            if with_engine and engine.can_use_engine(lm):
                engine.engine_for(lm)  # its slots, and on a CPU its first recorded buckets, before anyone asks
        except LmscopeError as e:  # the page will show the same sentence when it asks
            log.warning("default model not preloaded: %s", e)

    threading.Thread(target=load, name="lmscope-preload", daemon=True).start()


def serve(settings=None, host: str = "127.0.0.1", port: int = 7860, embedded_services: bool = True) -> None:
    """settings: the model_core.core.settings.Settings app/server/cli.py read at start (None: read them here)."""
    from model_core.core.settings import Settings, SettingsError

    if settings is None:
        try:
            settings = Settings.from_env()
        except SettingsError as e:
            log.error("bad configuration: %s", e)
            raise SystemExit(2) from None
    services = None
    if embedded_services and importlib.util.find_spec("tasks.services") is not None:
        from tasks.services import ensure_services

        services = ensure_services(settings.data_dir, settings=settings)
    global _services
    _services = services
    try:
        import uvicorn

        in_process = start_model_process(settings, services)
        app, _ = build_app(settings)
        _preload(settings.default_model, settings.device, settings.dtype, engine=in_process)
        # INFO: the level app/server/cli.py's logging shows by default, so whoever ran `make run` sees it
        log.info("serving on http://%s:%s (sign-in: %s)", host, port, settings.auth)
        uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        if _services is not None:
            _services.stop()
