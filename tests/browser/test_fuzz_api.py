"""Fuzz a live `lmscope serve` (sign-in on, shared token) with malformed and hostile inputs: each
must come back as a valid result or one clear sentence (no traceback, no server path, no URL)
within a time limit, never a 500 or a hang; the server logs no unexpected exception; and a normal
request still works afterwards.

- test_fuzz_public_api: /trace, /generate and /model_info through gradio_client on the real
  default model (200+ cases), plus raw HTTP without the sign-in cookie and with broken bodies.
- test_fuzz_every_event: every event in the page's Gradio config, public or private, reached by
  fn_index with raw `queue/join` requests (tests/helpers/raw_client.py): each input in turn replaced by
  hostile and wrong-typed values, the others at the page's own defaults.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import TimeoutError as FutureTimeout

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.real_model]

MODEL = "smollm2-135m-instruct"
TOKEN = "fuzz-token-0123456789"
PER_CALL_S = 60

# /trace: model, prompt, chat, truncate, layer, head, lens_colour, temperature, top_k, top_p, min_p, rep
TRACE_OK = [MODEL, "Hi", False, False, 0, 0, "probability", 1.0, 0, 1.0, 0.0, 1.0]
# /run (generate): model, prompt, chat, n_new, t, k, p, m, r, seed, stop, colour
GEN_OK = [MODEL, "Hi", False, 2, 0.0, 0, 1.0, 0.0, 1.0, 0, None, "prob"]

HOSTILE = [
    None, "", -1, -10**12, 10**12, 1e308, -1e308, math.nan, math.inf, -math.inf, True, [1, 2], {"a": 1},
    "../../etc/passwd", "/root", "org/model", "~/.ssh/id_rsa", "file:///etc/shadow",
    "\u202eevil\u202c RTL", "👨\u200d👩\u200d👧\u200d👦 ZWJ", "e" + "\u0301" * 200, "nul\x00byte", "1e309",
    "<script>alert(1)</script>",
]
BIG_STRINGS = ["x" * 200_000, "🙂" * 10_000, "ab " * 5000]


SLOW_PARAMS = [2, 3, 4, 5, 6]  # chat, truncate, layer, head, lens colour: most values are clamped -> a full trace
FEW = [None, -1, 10**12, math.nan, "../../etc/passwd"]


def _cases():
    """Endpoints x bad values. Parameters whose bad values fail fast get every value; those whose
    values are clamped into a full trace get a few, to keep the test near a minute on 2 CPU cores."""
    for i, v in itertools.product([0, 1, 7, 8, 9, 10, 11], HOSTILE):
        args = list(TRACE_OK)
        args[i] = v
        yield "/trace", args
    for i, v in itertools.product(SLOW_PARAMS, FEW):
        args = list(TRACE_OK)
        args[i] = v
        yield "/trace", args
    for v in BIG_STRINGS:
        yield "/trace", [MODEL, v, *TRACE_OK[2:]]
    for i, v in itertools.product([0, 3, 4, 5, 6, 8, 9], HOSTILE[:14]):
        args = list(GEN_OK)
        args[i] = v
        yield "/generate", args
    for v in HOSTILE + BIG_STRINGS:
        yield "/model_info", [v]


def _redact(v):
    s = repr(v)
    return s if len(s) < 60 else s[:57] + "..."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers.browser import LiveServer

    s = LiveServer(extra_env={"LMSCOPE_AUTH": "token", "LMSCOPE_AUTH_TOKEN": TOKEN,
                              "LMSCOPE_DATA_DIR": str(tmp_path_factory.mktemp("fuzz-data")),
                              "REDIS_URL": "redis://127.0.0.1:1/0"})
    yield s
    s.stop()


def _log(server) -> str:
    from tests.helpers.browser import ROOT

    p = ROOT / "artifacts" / f"server-{server.port}.log"
    return p.read_text(errors="replace") if p.exists() else ""


def _unexpected(server) -> list[str]:
    """Server-side failures that were not a sentence for the user (app.shared.context / app.server.api log these
    with a traceback; user errors are not logged)."""
    return re.findall(r"lmscope: unexpected error in [^\n]+|lmscope: request to [^\n]+failed in processing|"
                      r"Traceback \(most recent call last\)", _log(server))


def _post(url, body: bytes, headers=None):
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read()[:2000].decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:2000].decode(errors="replace")


def test_fuzz_public_api(server):
    from gradio_client import Client

    client = Client(server.url, auth=("fuzzer", TOKEN), verbose=False)
    # what a client sees is exactly the documented public API (app.server.api.PUBLIC_API, the README's table)
    from app.server.api import PUBLIC_API

    listed = {name.lstrip("/") for name in client.view_api(print_info=False, return_format="dict")["named_endpoints"]}
    assert listed == set(PUBLIC_API), listed ^ set(PUBLIC_API)
    cases = list(_cases())
    results = {"ok": 0, "error": 0}
    bad = []
    t_all = time.time()
    for api, args in cases:
        job = client.submit(*args, api_name=api if api != "/run" else "/generate")
        try:
            job.result(timeout=PER_CALL_S)
            results["ok"] += 1
        except FutureTimeout:
            bad.append((api, _redact(args), "hang"))
            job.cancel()
        except Exception as e:  # noqa: BLE001 - what kind, and is the message clear?
            msg = str(e).strip()
            results["error"] += 1
            if not msg or re.search(r"\b500\b.*Internal|Internal Server Error", msg) or msg in ("None", "Error"):
                bad.append((api, _redact(args), f"unclear error {type(e).__name__}: {msg[:200]}"))
        # every call answered within PER_CALL_S, or was recorded as a hang (which fails the test below)
        assert job.done() or (bad and bad[-1][2] == "hang"), (api, _redact(args))
    n_api = len(cases)

    # raw HTTP without the sign-in cookie: refused, never run
    raw = 0
    for api, body in itertools.product(["trace", "run", "model_info", "export", "submit", "cancel"],
                                       [json.dumps({"data": TRACE_OK}), "{", "[]", json.dumps({"data": "x"}), ""]):
        code, text = _post(server.url + f"gradio_api/call/{api}", body.encode())
        raw += 1
        if code not in (401, 403, 422):  # 422: a body that is not JSON is refused before sign-in is checked
            bad.append(("unauthenticated " + api, body[:40], f"HTTP {code}: {text[:100]}"))
    for path in ("gradio_api/queue/join", "gradio_api/upload", "gradio_api/info", "config"):
        code, text = _post(server.url + path, b'{"data": [], "fn_index": 0, "session_hash": "x"}')
        raw += 1
        if code == 500 or (path != "config" and code not in (401, 403, 405)):
            bad.append(("unauthenticated " + path, "", f"HTTP {code}: {text[:100]}"))

    print(f"\nfuzz: {n_api} API cases ({results}) + {raw} raw HTTP cases in {time.time() - t_all:.0f} s")
    assert n_api + raw >= 200
    unexpected = _unexpected(server)
    print(f"server errors it did not expect: {len(unexpected)}")
    assert not bad, "\n".join(map(str, bad[:40]))
    assert not unexpected, unexpected[:10]

    # the server keeps serving
    out = client.predict(MODEL, "The capital of France is", *TRACE_OK[2:], api_name="/trace")
    assert MODEL in out[0] and "tokens" in out[0]
    assert urllib.request.urlopen(server.url + "healthz", timeout=5).status == 200


# Hostile values for the walk over every event: wrong types, huge and odd text, made-up paths and
# file payloads, ids of things that do not exist.
WALK_VALUES = [None, "../../etc/passwd", {"path": "/etc/passwd", "meta": {"_type": "gradio.FileData"}},
               ["x"] * 5, "x" * 20_000, "🙂\u202e\x00"]
TINY = "random-llama-tiny"
_PATH_LEAK = re.compile(r"(/(root|home|tmp|work|usr|etc|var|opt)/\S+)|redis://|Traceback|File \"")


# Baseline values that keep each call cheap (the walk is about the answers, not the work).
BASELINE = {"gen-max-new": 2, "gen-n-samples": 2, "sft-mask-index": 0, "gen-steer-max-new": 2, "gen-steer-layer": 0,
            "explore-steer-layer": 0, "gen-clamp-max-new": 2}


def _is_model_picker(comp) -> bool:
    return comp["type"] == "dropdown" and "Model" in str(comp.get("props", {}).get("label"))


def _baseline(client, fn_index: int) -> list:
    """The page's own values for an event's inputs; the model picker set to a tiny model."""
    out = []
    for comp in client.inputs_of(fn_index):
        props = comp.get("props", {})
        v = BASELINE.get(props.get("elem_id"), props.get("value"))
        if comp["type"] in ("state", "browserstate"):
            v = None
        elif _is_model_picker(comp):
            v = TINY
        out.append(v)
    return out


def _one_sentence_problem(msg: str, sent=None) -> str | None:
    """What is wrong with an error message, if anything. The request's own values may be quoted
    back (an attacker learns nothing from their own path); anything else path-like may not."""
    for v in (sent, getattr(sent, "get", lambda k: None)("path")):
        if isinstance(v, str) and v:
            msg = msg.replace(v, "<sent>")
    if msg == "hang":
        return f"no answer within {PER_CALL_S} s"
    if not msg or msg in ("None", "Error", "(no message)", "stream closed"):
        return "no message"
    if _PATH_LEAK.search(msg):
        return "leaks a path, URL or traceback"
    if len(msg) > 400 or "\n" in msg.strip():
        return "not one sentence"
    return None


def test_fuzz_every_event(server):
    """Walk the config: one event per distinct (function, inputs), each input x WALK_VALUES."""
    from tests.helpers.raw_client import RawClient

    c = RawClient(server.url, "walker", TOKEN, timeout=PER_CALL_S)
    seen, events = set(), []
    for i, d in sorted(c.deps.items()):
        if not d.get("backend_fn"):
            continue
        key = (tuple(d["inputs"]), tuple(d["outputs"]))  # the same wiring twice (a button and Enter) is one case
        if key not in seen:
            seen.add(key)
            events.append(i)
    cases = []
    for i in events:
        base = _baseline(c, i)
        positions = range(len(base)) or [None]
        inputs = c.inputs_of(i)
        for pos, value in itertools.product(positions, WALK_VALUES):
            if pos is not None and inputs[pos]["type"] == "state":
                continue  # a gr.State's value is the session's on the server: Gradio's process_api drops what is sent
            if pos is not None and value is None and _is_model_picker(inputs[pos]):
                continue  # no model named = the default model: a legitimate (and slow) request
            data = list(base)
            if pos is not None:
                data[pos] = value
            # events that read the click (a table row, a token) get a hostile click too
            event_data = {"index": value, "value": value, "row_value": value} if c.deps[i]["collects_event_data"] else None
            cases.append((i, pos, value, data, event_data))

    import threading
    import uuid

    local = threading.local()

    def run(case):
        # one session per walker thread, as a browser tab keeps one: a new session costs the server a
        # config copy of every block (0.24 s for the page's ~700 on the main thread), more than most calls
        if not hasattr(local, "session"):
            local.session = uuid.uuid4().hex[:12]
        i, pos, value, data, event_data = case
        t_call = time.time()
        out = c.call(i, data, session=local.session, event_data=event_data)
        spent[i] = spent.get(i, 0.0) + time.time() - t_call
        problem = _one_sentence_problem(out["error"], value) if "error" in out else None
        return (c.deps[i].get("api_name"), pos, _redact(value), problem, out.get("error", "")[:200]) if problem else None

    from concurrent.futures import ThreadPoolExecutor

    spent: dict[int, float] = {}  # seconds of calls per event: what to trim when the walk grows
    t0 = time.time()
    with ThreadPoolExecutor(6) as pool:  # the server answers many at once; the walk waits on latency, not CPU
        results = list(pool.map(run, cases))
    bad, n = [r for r in results if r], len(cases)
    print(f"\nwalk: {len(events)} distinct events of {len(c.deps)}, {n} calls in {time.time() - t0:.0f} s")
    for i, s in sorted(spent.items(), key=lambda x: -x[1])[:10]:
        print(f"  {s:6.1f} s in calls of event {i} ({c.deps[i].get('api_name')})")
    assert len(events) > 40 and n >= 400
    assert not bad, "\n".join(map(str, bad[:30]))
    unexpected = _unexpected(server)
    assert not unexpected, unexpected[:10]
    out = c.call("trace", [TINY, "Still serving?", False, False, 0, 0, None, "probability", 1.0, 0, 1.0, 0.0, 1.0])
    assert TINY in out["data"][1]
    assert urllib.request.urlopen(server.url + "healthz", timeout=5).status == 200
