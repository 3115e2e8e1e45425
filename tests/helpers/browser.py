"""Helpers for the browser tests: a live `lmscope serve` on a free loopback port, and Debian's
Chromium driven by Playwright (never a downloaded browser)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts" / "screenshots"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, extra_env: dict | None = None, args: tuple = ("--no-services",)):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {**os.environ, "LMSCOPE_DEVICE": "cpu", "GRADIO_ANALYTICS_ENABLED": "False", **(extra_env or {})}
        self.log = open(ROOT / "artifacts" / f"server-{self.port}.log", "w") if (ROOT / "artifacts").exists() else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "app.server.cli", "serve", "--port", str(self.port), *args],
                                     cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(self.url, timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("server did not start in 180 s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextlib.contextmanager
def server_with_jobs(data_dir: Path, stale_s: float = 60):
    """A real Valkey and Celery worker on `data_dir`, and a live server using them: (services, server)."""
    from tests.helpers.services import LiveServices

    svc = LiveServices(data_dir, stale_s=stale_s).start()
    server = None
    try:
        server = LiveServer(extra_env=svc.env())
        yield svc, server
    finally:
        if server is not None:
            server.stop()
        svc.stop()


def launch_browser(playwright):
    return playwright.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)


def plot_data(page, elem_id: str) -> list[dict]:
    """The Plotly traces currently drawn in the gr.Plot with this elem_id."""
    return json.loads(page.evaluate(
        """(id) => { const el = document.querySelector('#' + id + ' .js-plotly-plot');
                     if (!el || !el._fullData) return '[]';
                     // typed arrays (Plotly's binary encoding, decoded) -> plain arrays
                     const norm = v => ArrayBuffer.isView(v) ? Array.from(v) : (Array.isArray(v) ? v.map(norm) : v);
                     return JSON.stringify(el._fullData.map(t => ({type: t.type, x: norm(t.x), y: norm(t.y),
                                                                    z: norm(t.z), text: norm(t.text)}))); }""",
        elem_id))


def plot_title(page, elem_id: str) -> str:
    return page.evaluate(
        """(id) => { const el = document.querySelector('#' + id + ' .js-plotly-plot');
                     return el && el.layout && el.layout.title ? (el.layout.title.text || '') : ''; }""", elem_id)


def wait_until(cond, timeout: float = 60, what: str = "condition", every: float = 0.2) -> None:
    """Poll cond() until it is true; fail the test with `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def recorded_calls(url: str, model: str = "smollm2-135m-instruct") -> dict | None:
    """The server's recorded CPU calls for `model` (GET /metrics: buckets, replays by kind, buckets
    still waiting to be recorded), or None while it has no engine or records nothing."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        models = json.loads(r.read()).get("models") or []
    return next(((m.get("engine") or {}).get("recorded_steps") for m in models if m.get("name") == model), None)


def wait_title(page, elem_id: str, needle: str, timeout: float = 60) -> None:
    """Wait until the plot's title contains `needle` (a view has redrawn)."""
    try:
        wait_until(lambda: needle in plot_title(page, elem_id), timeout, f"{elem_id} title to contain {needle!r}")
    except AssertionError as e:
        raise AssertionError(f"{e}; it is {plot_title(page, elem_id)!r}") from None


def set_number(page, elem_id: str, value, held: bool = False) -> None:
    """Type into a slider's/number's number box and commit it like a user (Enter). held: then leave
    the box and wait until the slider's track shows the value (a click right after the typing could
    otherwise send the old value on a loaded machine); only for a value inside the slider's range."""
    box = page.locator(f"#{elem_id} input[type=number]").first
    track = page.locator(f"#{elem_id} input[type=range]").first

    def type_it():
        box.fill(str(value))
        box.press("Enter")

    if not held:
        type_it()
        return
    # A component mounting as its accordion opens can replace the box just typed into (CI once saw the
    # slider keep its default for 10 s on a loaded machine), so the value is typed again until both the
    # box and the track show it.
    for _ in range(3):
        type_it()
        box.blur()
        try:
            wait_until(lambda: float(box.input_value()) == float(value) == float(track.input_value()), 5)
            return
        except AssertionError:
            continue
    raise AssertionError(f"{elem_id} does not hold {value}: the box shows {box.input_value()!r}, "
                         f"the track {track.input_value()!r}")


def screenshot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
