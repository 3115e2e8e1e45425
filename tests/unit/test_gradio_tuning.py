"""app.server.gradio_tuning: skipped outputs answer what Gradio itself answers, without Gradio rebuilding
the component and its config for each (the reference is Gradio's own Blocks.postprocess_data,
run on the same predictions); the queue polls less often; a session's component configs are
worked out when first used and come out as Gradio's own eager SessionState has them; a page's
config is copied once per address and answers what Gradio's own /config route answers.

These changes (and app/server/api.py's wrappers of process_api and the queue's push, app/server/main.py's
has_launched and its sys.modules marks) lean on Gradio's internals: the installed Gradio must be the
version they were written against, with the parameters, attributes and source they expect, and a change
that finds another shape must say so in the log."""

import asyncio
import inspect
import logging
import tomllib
from pathlib import Path

import gradio as gr
import plotly.graph_objects as go
from gradio.blocks import Blocks
from gradio.state_holder import SessionState

from app.server import gradio_tuning


def _gradio_own():
    method = Blocks.postprocess_data
    return getattr(method, "__wrapped__", method)  # the unpatched method, patched or not


def _demo():
    with gr.Blocks() as demo:
        md, plot, slider, text, msg = gr.Markdown("a"), gr.Plot(), gr.Slider(0, 10), gr.Textbox(), gr.Markdown()
        button = gr.Button()
        button.click(lambda: None, None, [md, plot, slider, text, msg])
    return demo, [md, plot, slider, text, msg]


def _run(method, demo, predictions):
    state = SessionState(demo)
    fn = next(iter(demo.fns.values()))
    before = {k: id(v) for k, v in state.blocks_config.blocks.items()}
    out = asyncio.run(method(demo, fn, predictions, state))
    rebuilt = {k for k, v in state.blocks_config.blocks.items() if before.get(k) != id(v)}
    return out, rebuilt


def test_skipped_outputs_answer_what_gradio_answers_without_rebuilding_them():
    assert gradio_tuning.skip_unchanged_outputs()
    assert gradio_tuning.skip_unchanged_outputs()  # installing twice wraps once
    patched = Blocks.postprocess_data
    assert patched.__wrapped__ is _gradio_own()
    demo, (md, plot, slider, text, msg) = _demo()
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    cases = [  # made afresh for each run: Gradio pops keys out of an update
        lambda: {md: "new text", slider: gr.update(maximum=5, value=2)},  # three outputs skipped
        lambda: {text: "only this"},  # one output kept: Gradio's single-output path
        lambda: {msg: gr.update(value="⚠️ bad", visible=True), plot: fig},
        lambda: {md: gr.skip()},  # every output skipped
        lambda: ["x", gr.skip(), gr.skip(), "y", gr.skip()],  # a list, not a dict
        lambda: {md: "a", plot: fig, slider: 3, text: "t", msg: "m"},  # nothing skipped: Gradio's own path
    ]
    outputs = [md, plot, slider, text, msg]
    for make in cases:
        case = make()
        ours, rebuilt = _run(patched, demo, make())
        theirs, theirs_rebuilt = _run(_gradio_own(), demo, make())
        assert ours == theirs, case
        values = [case.get(c, gr.skip()) for c in outputs] if isinstance(case, dict) else case
        skipped = {c._id for c, v in zip(outputs, values) if v == gr.skip()}
        assert skipped <= theirs_rebuilt  # Gradio rebuilds a skipped component for the session
        assert not (skipped & rebuilt), case  # with the patch it does not


def test_bad_predictions_still_get_gradios_message():
    gradio_tuning.skip_unchanged_outputs()
    demo, (md, *_rest) = _demo()
    stranger = gr.Textbox(render=False)
    for bad in ({stranger: "x"}, ["only one", gr.skip()]):
        errors = []
        for method in (Blocks.postprocess_data, _gradio_own()):
            try:
                _run(method, demo, bad)
                errors.append(None)
            except Exception as e:  # noqa: BLE001
                errors.append((type(e), str(e)))
        assert errors[0] == errors[1] and errors[0] is not None


def test_queue_polls_every_10_ms_not_every_ms():
    demo, _ = _demo()
    demo.queue()
    assert demo._queue.sleep_when_free < gradio_tuning.QUEUE_POLL_S  # Gradio's own: 1 ms
    assert gradio_tuning.poll_queue_every(demo)
    assert demo._queue.sleep_when_free == gradio_tuning.QUEUE_POLL_S
    assert demo._queue.progress_update_sleep_when_free == gradio_tuning.PROGRESS_POLL_S
    assert not gradio_tuning.poll_queue_every(object())  # not a queued demo: nothing to change


def _finish_events(queue, n: int) -> None:
    """What Gradio's queue does for each of n events: record it when pushed (Queue.push), mark it done
    and summarize the records (Queue.process_events)."""
    for i in range(n):
        queue.event_analytics[f"e{i}"] = {"time": float(i), "status": "queued", "process_time": None,
                                          "function": f"fn{i % 3}", "session_hash": "s"}
        queue.events_recorded += 1
        queue.events_recorded_per_fn[f"fn{i % 3}"] += 1
        while len(queue.event_analytics) > queue.ANALYTICS_MAX_EVENTS:
            queue.event_analytics.pop(next(iter(queue.event_analytics)))
        queue.event_analytics[f"e{i}"].update(status="success", process_time=0.01)
        queue.compute_analytics_summary(list(queue.event_analytics.values()))


def test_a_finished_event_is_not_summarized_with_all_recorded_before_it(monkeypatch):
    from gradio.queueing import Queue

    frames = []
    own_get_df = Queue._get_df
    monkeypatch.setattr(Queue, "_get_df", staticmethod(lambda records: frames.append(len(records)) or own_get_df(records)))
    for tuned in (False, True):
        demo, _ = _demo()
        demo.queue()
        if tuned:
            assert gradio_tuning.no_event_summaries(demo)
        frames.clear()
        _finish_events(demo._queue, gradio_tuning.EVENTS_RECORDED + 50)
        if tuned:  # no DataFrame at all, and only the newest records kept
            assert frames == [] and len(demo._queue.event_analytics) == gradio_tuning.EVENTS_RECORDED
        else:  # Gradio's own: a DataFrame of every record so far after each event
            assert len(frames) == gradio_tuning.EVENTS_RECORDED + 50 and frames[-1] == gradio_tuning.EVENTS_RECORDED + 50
    assert not gradio_tuning.no_event_summaries(object())  # not a queued demo: nothing to change


def _gradio_own_session(demo):
    """A SessionState made and read by Gradio's own code, patched or not."""
    state = SessionState.__new__(SessionState)
    getattr(SessionState.__init__, "__wrapped__", SessionState.__init__)(state, demo)
    own_components = getattr(SessionState.components.fget, "__wrapped__", SessionState.components.fget)
    return state, lambda: list(own_components(state))


def _counting_configs(monkeypatch):
    from gradio.blocks import BlocksConfig

    calls, original = [], BlocksConfig.config_for_block
    monkeypatch.setattr(BlocksConfig, "config_for_block",  # a static method in Gradio 6
                        staticmethod(lambda *a, **k: calls.append(a[0]) or original(*a, **k)))
    return calls


def test_session_configs_are_worked_out_when_used_and_equal_gradios_own(monkeypatch):
    assert gradio_tuning.lazy_session_configs()
    assert gradio_tuning.lazy_session_configs()  # installing twice patches once
    assert getattr(SessionState.__init__, "__lmscope_lazy__", False)
    demo, (md, plot, slider, text, msg) = _demo()
    fn = next(iter(demo.fns.values()))
    calls = _counting_configs(monkeypatch)
    theirs, their_components = _gradio_own_session(demo)
    assert len(calls) == len(demo.blocks)  # Gradio: every block's config at the session's start
    calls.clear()
    ours = SessionState(demo)
    assert calls == []  # lazily: none
    fig = go.Figure(go.Bar(x=[1, 2], y=[3, 4]))
    for state in (theirs, ours):  # the same events on both: inputs recorded, outputs and updates
        state._update_value_in_config(text._id, "typed")
        asyncio.run(_gradio_own()(demo, fn, [gr.update(value="b", visible=False), fig,
                                             gr.update(maximum=5, value=2), "t", gr.update(visible=True)], state))
    assert [c["id"] for c in their_components()] == [c["id"] for c in ours.components]  # Gradio's order
    assert their_components() == list(ours.components)
    assert {c["id"]: c for c in ours.components}[slider._id]["props"]["maximum"] == 5
    assert {c["id"]: c for c in ours.components}[text._id]["props"]["value"] == "t"


def test_the_served_app_has_all_five():
    """What `lmscope serve` builds (app.server.main.build_app) runs with the five changes in place, and
    Gradio's monitoring summary (no longer worked out) is refused, not served empty."""
    import sys

    from fastapi.testclient import TestClient

    from app.server.main import build_app
    from model_core.core.settings import Settings

    marked_before = {n for n, m in sys.modules.items() if m is None}
    try:
        app, demo = build_app(Settings.from_env())
        gradio_app = next(r.app for r in app.routes if getattr(r, "path", None) == "")
        config_routes = [r for r in gradio_app.router.routes if getattr(r, "path", None) in ("/config", "/config/")]
        assert len(config_routes) == 2 and all(getattr(r.endpoint, "__lmscope_cached__", False) for r in config_routes)
        assert getattr(Blocks.postprocess_data, "__lmscope_skips__", False)
        assert getattr(SessionState.__init__, "__lmscope_lazy__", False)
        assert demo._queue.sleep_when_free == gradio_tuning.QUEUE_POLL_S
        assert demo._queue.ANAYLTICS_CACHE_FREQUENCY == sys.maxsize
        assert TestClient(app).get("/monitoring/summary").status_code == 403
    finally:  # build_app marks absent plotting libraries as missing: leave sys.modules as it was
        for name in [n for n, m in sys.modules.items() if m is None and n not in marked_before]:
            del sys.modules[name]


def test_page_config_is_copied_once_per_address_and_equals_gradios_own(monkeypatch):
    """cache_page_config: /config answers what Gradio's own route answers (the reference: the same
    app's answer before the change), per address (behind a proxy's X-Forwarded-Host too) and per
    signed-in user, while Gradio copies the page's config once per address instead of per load."""
    import gradio.utils
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    demo, _ = _demo()
    app = gr.mount_gradio_app(FastAPI(), demo, path="", auth=[("alice", "pw"), ("bob", "pw")])
    gradio_app = next(r.app for r in app.routes if getattr(r, "path", None) == "")

    def signed_in(user):
        c = TestClient(app)
        assert c.post("/login", data={"username": user, "password": "pw"}).status_code == 200
        return c

    clients = {u: signed_in(u) for u in ("alice", "bob")}
    asks = [(u, h) for u in clients for h in ({}, {"X-Forwarded-Host": "lab.example.org"})]

    def answers():
        out = []
        for u, headers in asks:
            r = clients[u].get("/config", headers=headers)
            assert r.status_code == 200
            out.append(r.json())
        return out

    theirs = answers()
    assert theirs[0]["username"] == "alice" and "lab.example.org" in str(theirs[1]) and theirs[0] != theirs[1]
    copies = []
    own_copy = gradio.utils.safe_deepcopy
    monkeypatch.setattr(gradio.utils, "safe_deepcopy", lambda x: copies.append(1) or own_copy(x))
    assert gradio_tuning.cache_page_config(gradio_app)
    assert gradio_tuning.cache_page_config(gradio_app)  # installing twice replaces once
    assert answers() == theirs
    assert answers() == theirs
    assert len(copies) == 2  # one per address, not one per page load (8 loads)
    assert TestClient(app).get("/config").status_code == 401  # not signed in: Gradio's own check still runs
    assert clients["bob"].get("/config", params={"deep_link": "nope"}).json()["deep_link_state"] == "invalid"


def test_the_installed_gradio_is_the_one_the_changes_were_written_against():
    """An upgrade is a deliberate step: re-read every change against the new Gradio, then move the pin
    in pyproject.toml and gradio_tuning.GRADIO_VERSION together."""
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text(encoding="utf-8"))
    assert f"gradio=={gradio_tuning.GRADIO_VERSION}" in pyproject["project"]["dependencies"]
    assert gr.__version__ == gradio_tuning.GRADIO_VERSION


def _config_endpoints():
    from gradio.routes import App

    demo, _ = _demo()
    app = App.create_app(demo)
    return [r.endpoint for r in app.router.routes if getattr(r, "path", None) in ("/config", "/config/")]


def test_what_the_changes_wrap_has_the_parameters_they_pass_on():
    from gradio import route_utils
    from gradio.blocks import BlocksConfig
    from gradio.queueing import Queue

    config = _config_endpoints()
    assert len(config) == 2 and config[0] is config[1]  # one endpoint for /config and /config/
    wrapped = {"Blocks.postprocess_data": Blocks.postprocess_data, "SessionState.__init__": SessionState.__init__,
               "BlocksConfig.config_for_block": BlocksConfig.config_for_block, "/config": config[0],
               "route_utils.get_root_url": route_utils.get_root_url, "Blocks.process_api": Blocks.process_api,
               "Queue.push": Queue.push}
    assert set(wrapped) == set(gradio_tuning.PARAMS)
    for name, fn in wrapped.items():
        assert gradio_tuning.params(inspect.unwrap(fn)) == gradio_tuning.PARAMS[name], name
    for fn in (Blocks.postprocess_data, Blocks.process_api, Queue.push):  # awaited by the wrappers
        assert inspect.iscoroutinefunction(inspect.unwrap(fn)), fn
    assert isinstance(inspect.getattr_static(BlocksConfig, "config_for_block"), staticmethod)


def test_what_the_changes_read_and_set_is_still_there():
    from gradio import blocks, processing_utils, queueing, utils
    from gradio.components import plot

    assert isinstance(blocks.Block, type) and callable(blocks.convert_component_dict_to_list)  # skip_unchanged_outputs
    own_init = inspect.getsource(inspect.unwrap(SessionState.__init__))  # lazy_session_configs imitates it
    components = inspect.getattr_static(SessionState, "components")
    assert "config_for_block" in own_init and "blocks.default_config" in own_init
    assert "config_values" in inspect.getsource(inspect.unwrap(components.fget))
    demo, _ = _demo()
    demo.queue()
    for name in ("sleep_when_free", "progress_update_sleep_when_free"):  # poll_queue_every
        assert isinstance(getattr(demo._queue, name), (int, float)), name
    for name in ("ANAYLTICS_CACHE_FREQUENCY", "ANALYTICS_MAX_EVENTS"):  # no_event_summaries
        assert isinstance(getattr(demo._queue, name), int), name
    assert "ANAYLTICS_CACHE_FREQUENCY" in inspect.getsource(queueing.Queue.compute_analytics_summary)
    assert isinstance(demo._queue.event_ids_to_events, dict)  # api.limit_queue_share counts a user's events ...
    assert {"session_hash", "username"} <= set(inspect.signature(queueing.Event.__init__).parameters)  # ... by these
    # main.build_app sets has_launched on the mounted demo: Gradio's check that an input file came through
    # its upload route runs only on a demo that has it
    assert demo.has_launched is False
    assert "blocks.has_launched" in inspect.getsource(processing_utils._check_allowed)
    # main.mark_missing_optional_imports: Gradio tries these imports and takes ImportError as "not installed"
    for fn, name in ((plot.Plot.get_config, "bokeh"), (utils.MatplotlibBackendMananger.__enter__, "matplotlib")):
        source = inspect.getsource(fn)
        assert f"import {name}" in source and "except ImportError" in source, name


def test_a_change_that_finds_another_shape_says_so_and_leaves_gradio_as_it_is(monkeypatch, caplog):
    from fastapi import FastAPI

    async def postprocess_data(self, block_fn, predictions, state, extra=None):  # a new parameter
        return predictions

    def session_init(self, blocks, extra=None):
        pass

    monkeypatch.setattr(Blocks, "postprocess_data", postprocess_data)
    monkeypatch.setattr(SessionState, "__init__", session_init)
    no_config = FastAPI()
    other_config = FastAPI()
    other_config.get("/config")(lambda request, user=None: {})
    with caplog.at_level(logging.WARNING, logger=gradio_tuning.__name__):
        assert not gradio_tuning.skip_unchanged_outputs()
        assert not gradio_tuning.lazy_session_configs()
        assert not gradio_tuning.poll_queue_every(object())
        assert not gradio_tuning.no_event_summaries(object())
        assert not gradio_tuning.cache_page_config(no_config)
        assert not gradio_tuning.cache_page_config(other_config)
    assert Blocks.postprocess_data is postprocess_data and SessionState.__init__ is session_init  # untouched
    warned = [r.getMessage() for r in caplog.records if r.name == gradio_tuning.__name__ and r.levelno == logging.WARNING]
    for change in ("skip_unchanged_outputs", "lazy_session_configs", "poll_queue_every", "no_event_summaries",
                   "cache_page_config"):
        assert any(f"{change} is not applied" in m for m in warned), change
    assert sum("cache_page_config" in m for m in warned) == 2
