"""A hand-made Gradio client for the security tests: it signs in through POST /login like a
browser, then sends raw `queue/join` requests by fn_index with whatever data it likes, private
events included (what an attacker with an account can do; gradio_client cannot reach those)."""

from __future__ import annotations

import json
import time
import uuid

import httpx


class RawClient:
    def __init__(self, url: str, user: str | None = None, password: str | None = None, timeout: float = 120):
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        self.timeout = timeout
        if user is not None:
            r = self.http.post("/login", data={"username": user, "password": password})
            assert r.status_code == 200, r.text
        self.config = self.http.get("/config").json()
        self.deps = {d["id"]: d for d in self.config["dependencies"]}
        self.components = {c["id"]: c for c in self.config["components"]}

    def fn(self, api_name: str) -> int:
        return next(i for i, d in self.deps.items() if d.get("api_name") == api_name)

    def fns_named(self, backend_name_part: str) -> list[int]:
        return [i for i, d in self.deps.items() if backend_name_part in (d.get("api_name") or "")]

    def join(self, fn_index: int, data: list, session: str | None = None, event_data=None) -> tuple[int, str, str]:
        """Queue one event; returns (HTTP status, event id or error text, session hash)."""
        session = session or uuid.uuid4().hex[:12]
        r = self.http.post("/gradio_api/queue/join", json={"data": data, "fn_index": fn_index, "session_hash": session,
                                                          "event_data": event_data, "trigger_id": None})
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"detail": r.text}
        return r.status_code, body.get("event_id") or str(body.get("detail")), session

    def result(self, session: str, timeout: float | None = None) -> dict:
        """Read the session's stream until its event completes: {"data": [...]} or {"error": "..."};
        {"error": "hang"} past `timeout` (the stream's heartbeats would keep a read timeout from firing)."""
        deadline = time.monotonic() + (timeout or self.timeout)
        self.started_at = None  # time.perf_counter() when the server started running the event
        self.first_update_at = None  # ... and when its first streamed update arrived (a generator's first yield)
        with self.http.stream("GET", f"/gradio_api/queue/data?session_hash={session}") as resp:
            for line in resp.iter_lines():
                if time.monotonic() > deadline:
                    return {"error": "hang"}
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                if msg.get("msg") == "process_starts":
                    self.started_at = time.perf_counter()
                if msg.get("msg") == "process_generating" and self.first_update_at is None:
                    self.first_update_at = time.perf_counter()
                if msg.get("msg") == "process_completed":
                    out = msg.get("output") or {}
                    return {"error": out.get("error") or "(no message)"} if not msg.get("success") else out
        return {"error": "stream closed"}

    def call(self, fn_index: int | str, data: list, session: str | None = None, event_data=None) -> dict:
        if isinstance(fn_index, str):
            fn_index = self.fn(fn_index)
        status, text, session = self.join(fn_index, data, session, event_data)
        if status != 200:
            return {"error": text, "status": status}
        return self.result(session)

    def inputs_of(self, fn_index: int) -> list[dict]:
        return [self.components[i] for i in self.deps[fn_index]["inputs"]]

    def data_for(self, fn_index: int, given: dict) -> list:
        """An event's inputs as the page sends them: `given` by component label, the rest at the page's
        defaults, a State as null (its value lives in the server's session)."""
        return [None if c["type"] == "state" else given.get(c.get("props", {}).get("label"), c.get("props", {}).get("value"))
                for c in self.inputs_of(fn_index)]

    def upload(self, name: str, content: bytes) -> dict:
        r = self.http.post("/gradio_api/upload", files={"files": (name, content)})
        assert r.status_code == 200, r.text
        return {"path": r.json()[0], "orig_name": name, "meta": {"_type": "gradio.FileData"}}
