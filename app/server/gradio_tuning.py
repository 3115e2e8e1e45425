"""Five places where Gradio's own work held the interpreter that the engine thread needs.

The first two were found with py-spy during a streamed generation, the third by timing each phase of
a `queue/join`, the fourth and fifth with py-spy during `bench/load.py` and `bench/served.py`
(docs/PERFORMANCE.md): the engine thread runs ~1,500 torch calls a token and takes
the GIL back after each, so any Python the event loop runs meanwhile is a token's time lost.

1. Outputs a callback leaves alone cost nothing (`skip_unchanged_outputs`).

A handler that returns `{component: value}` for some of its event's outputs leaves the others as
`gr.skip()`, the empty update `{"__type__": "update"}`. Gradio 6 (6.31) treats that like any
property update: it builds a fresh copy of the component for the session and works out its
config twice (`Component.api_info` runs pydantic's JSON-schema generation), about 1 ms of the
event loop's interpreter per skipped output per update. The Generate tab streams ten updates a
second to an event with ten outputs it does not touch while streaming, so the event loop held the
interpreter for ~20 % of a generation's wall time, most of it rebuilding components that did not
change, and the engine thread waited for it between its torch calls (docs/PERFORMANCE.md).

`skip_unchanged_outputs()` wraps `Blocks.postprocess_data` so that outputs whose value is exactly the empty update
skip that work: the others go through Gradio unchanged (a shallow copy of the event's function
with only their outputs), and the skipped ones answer the same `{"__type__": "update"}` Gradio
itself would have sent. Nothing is patched where the method does not look as expected.

2. The queue does not poll every millisecond (`poll_queue_every`).

Gradio's queue loop looks for work every 1 ms while it has none or every worker is busy, and
for progress to send every 10 ms: over a thousand wake-ups a second of the event loop, each
taking the interpreter. Every 10 ms (progress every 50 ms) is still too soon for anyone to notice.

3. A new session does not work out every component's config up front (`lazy_session_configs`).

Gradio keeps, per browser session, the config of every component of the page (for its deep-link
feature, which lmscope does not use) and computes all of them when the session sends its first
event: 728 components, 80-190 ms of the event loop, while every other user's stream waits. Now
each is worked out the first time Gradio reads or changes it, and all of them, in Gradio's own
order, when a deep link asks for the lot (tested equal to Gradio's own).

4. A page load does not copy the whole page's config (`cache_page_config`).

Every page load asks `/config`, and Gradio answers it with a deep copy of the page's config
(~900 KB of JSON for lmscope: 70-100 ms of pure Python on an idle server) and a walk over the copy
to put the server's address into it. Twenty users opening the page at once spent seconds of the
interpreter on that while the others' traces and generations waited (py-spy, under bench/load.py:
more samples than every trace's forward). The copy depends only on the address the page was
asked at, so it is made once per address; each answer is that copy with the user's name, from
Gradio's own code (tested equal to Gradio's answer). Deep links and multi-page requests go to
Gradio as before.

5. A finished event does not summarize the last 10,000 (`no_event_summaries`).

After every event that finishes, Gradio's queue builds a pandas DataFrame of the last 10,000 events
it recorded and works out each function's success rate and time percentiles, for its monitoring
dashboard (`/monitoring`): 20-31 ms of a core per finished event here (100 to 10,000 recorded), as
much again as an Explore layer switch's own work, on a worker thread that holds the interpreter. lmscope
serves its own /metrics and mounts Gradio with monitoring off (so `/monitoring/summary` is refused
rather than serving a summary never worked out), so the summary is never worked out and only the
events in flight are recorded (Gradio reads their records while they run, if they are there).

Each of the five reaches into Gradio's internals, so pyproject.toml pins Gradio to GRADIO_VERSION,
the version they were written against, and each checks the shape it relies on (the parameters of the
method it wraps, PARAMS below; the names in the source it imitates) before it changes anything. One
that finds another shape leaves Gradio's own path in place and logs a warning: the app stays correct,
only slower. tests/unit/test_gradio_tuning.py fails when the installed Gradio is another version or
any of these shapes changed, so an upgrade is a deliberate step: re-read each change against the
new Gradio, then move the pin and GRADIO_VERSION together.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import sys

logger = logging.getLogger(__name__)

GRADIO_VERSION = "6.31.0"  # what these changes were written against (pyproject.toml pins gradio to it)
# The parameters each function lmscope wraps or replaces has in GRADIO_VERSION; the wrappers pass
# them on by name. The last two are wrapped in app/server/api.py (harden, limit_queue_share).
PARAMS = {
    "Blocks.postprocess_data": ["self", "block_fn", "predictions", "state"],
    "SessionState.__init__": ["self", "blocks"],
    "BlocksConfig.config_for_block": ["_id", "rendered_ids", "block", "renderable"],
    "/config": ["request", "user", "deep_link", "page"],
    "route_utils.get_root_url": ["request", "route_path", "root_path"],
    "Blocks.process_api": ["self", "block_fn", "inputs", "state", "request", "iterator", "session_hash", "event_id",
                           "event_data", "in_event_listener", "simple_format", "explicit_call", "root_path",
                           "oauth_token"],
    "Queue.push": ["self", "body", "request", "username"],
}


def params(fn) -> list[str]:
    """The parameter names of `fn`, as PARAMS lists them."""
    return list(inspect.signature(fn).parameters)


def _decline(change: str, why: str) -> bool:
    """Log that `change` is left out (Gradio runs its own path there), and return False."""
    import gradio

    logger.warning("Gradio %s (these changes were written against %s): %s is not applied: %s.",
                   gradio.__version__, GRADIO_VERSION, change, why)
    return False


EMPTY_UPDATE = {"__type__": "update"}


def _is_skip(value) -> bool:
    return isinstance(value, dict) and value == EMPTY_UPDATE


QUEUE_POLL_S = 0.01
PROGRESS_POLL_S = 0.05


def poll_queue_every(demo, seconds: float = QUEUE_POLL_S, progress_seconds: float = PROGRESS_POLL_S) -> bool:
    """Make a queued demo's polling for work `seconds` apart (Gradio: 1 ms) and for progress
    `progress_seconds` apart (Gradio: 10 ms). False where the queue has no such settings."""
    queue = getattr(demo, "_queue", None)
    names = {"sleep_when_free": seconds, "progress_update_sleep_when_free": progress_seconds}
    if queue is None or not all(isinstance(getattr(queue, n, None), (int, float)) for n in names):
        return _decline("poll_queue_every", "the demo has no queue with numeric " + " and ".join(names))
    for name, value in names.items():
        setattr(queue, name, max(getattr(queue, name), value))
    return True


EVENTS_RECORDED = 1024  # no_event_summaries: more than the queue holds at once (LMSCOPE_QUEUE_MAX's most is
# 100,000, but a record is only read while its event runs, and a missing one is skipped by Gradio)


def no_event_summaries(demo) -> bool:
    """Stop a queued demo's queue from summarizing its recorded events after each finished one, and keep
    only the last EVENTS_RECORDED records. False where the queue has no such settings."""
    queue = getattr(demo, "_queue", None)
    names = ("ANAYLTICS_CACHE_FREQUENCY", "ANALYTICS_MAX_EVENTS")  # sic: Gradio's spelling
    if queue is None or not all(isinstance(getattr(queue, n, None), int) for n in names):
        return _decline("no_event_summaries", "the demo has no queue with integer " + " and ".join(names))
    queue.ANAYLTICS_CACHE_FREQUENCY = sys.maxsize  # events since the last summary never reach it
    queue.ANALYTICS_MAX_EVENTS = min(queue.ANALYTICS_MAX_EVENTS, EVENTS_RECORDED)
    return True


def skip_unchanged_outputs() -> bool:
    """Patch gradio.Blocks.postprocess_data once. False where Gradio's method is not the shape this
    was written against (the app then runs on Gradio's own path)."""
    from gradio.blocks import Block, Blocks, convert_component_dict_to_list

    original = Blocks.postprocess_data
    if getattr(original, "__lmscope_skips__", False):
        return True
    if params(original) != PARAMS["Blocks.postprocess_data"] or not inspect.iscoroutinefunction(original):
        return _decline("skip_unchanged_outputs", f"Blocks.postprocess_data{inspect.signature(original)} is not "
                        f"a coroutine function of {PARAMS['Blocks.postprocess_data']}")

    @functools.wraps(original)
    async def postprocess_data(self, block_fn, predictions, state):
        outputs = list(getattr(block_fn, "outputs", None) or [])
        if len(outputs) < 2 or getattr(block_fn, "batch", False) or getattr(block_fn, "is_validator_function", False):
            return await original(self, block_fn, predictions, state)
        if isinstance(predictions, dict) and predictions and all(isinstance(k, Block) for k in predictions):
            predictions = convert_component_dict_to_list(outputs, predictions)
        if not isinstance(predictions, (list, tuple)) or len(predictions) != len(outputs):
            return await original(self, block_fn, predictions, state)  # Gradio says what is wrong
        kept = [i for i, p in enumerate(predictions) if not _is_skip(p)]
        if len(kept) == len(outputs):
            return await original(self, block_fn, predictions, state)
        answer = [dict(EMPTY_UPDATE) for _ in outputs]
        if kept:
            part = copy.copy(block_fn)
            part.outputs = [outputs[i] for i in kept]
            values = [predictions[i] for i in kept]
            done = await original(self, part, values if len(kept) > 1 else values[0], state)
            for i, v in zip(kept, done):
                answer[i] = v
        return answer

    postprocess_data.__lmscope_skips__ = True
    Blocks.postprocess_data = postprocess_data
    return True


def lazy_session_configs() -> bool:
    """Patch gradio.state_holder.SessionState once so that its per-component configs are computed
    on first use instead of all at the session's first event. False where SessionState is not the
    shape this was written against (the app then runs on Gradio's own path)."""
    from types import SimpleNamespace

    from gradio.blocks import BlocksConfig
    from gradio.state_holder import SessionState

    original_init = SessionState.__init__
    if getattr(original_init, "__lmscope_lazy__", False):
        return True
    components = SessionState.__dict__.get("components")
    if params(original_init) != PARAMS["SessionState.__init__"] or not isinstance(components, property):
        return _decline("lazy_session_configs", "SessionState.__init__ does not take (self, blocks), or "
                        "SessionState.components is not a property")
    init_source = inspect.getsource(original_init)
    if "config_for_block" not in init_source or "blocks.default_config" not in init_source \
            or "config_values" not in inspect.getsource(components.fget):
        return _decline("lazy_session_configs", "SessionState no longer fills config_values from "
                        "blocks.default_config with config_for_block")
    if params(BlocksConfig.config_for_block) != PARAMS["BlocksConfig.config_for_block"]:
        return _decline("lazy_session_configs", "BlocksConfig.config_for_block does not take "
                        f"{PARAMS['BlocksConfig.config_for_block']}")

    @functools.wraps(original_init)
    def __init__(self, blocks):
        # Gradio's own __init__ with no block to precompute: the same state, config_values empty
        original_init(self, SimpleNamespace(default_config=blocks.default_config, blocks={}))
        # the blocks Gradio would have worked out now (shared, unchanged after launch): later, the same
        self._lmscope_config_order = [(k, v) for k, v in self.blocks_config.blocks.items() if k in blocks.blocks]

    def all_configs(self):
        """config_values as Gradio's eager __init__ would have it: every block of the page in the
        page's order, then any added later in the order they came."""
        order = getattr(self, "_lmscope_config_order", None)
        if order is not None:
            done = self.config_values
            filled = {k: done[k] if k in done else self.blocks_config.config_for_block(k, [], v) for k, v in order}
            filled.update((k, v) for k, v in done.items() if k not in filled)
            self.config_values = filled
            self._lmscope_config_order = None
        return components.fget(self)

    all_configs.__wrapped__ = components.fget
    __init__.__lmscope_lazy__ = True
    SessionState.__init__ = __init__
    SessionState.components = property(all_configs, doc=components.__doc__)
    return True


CONFIG_ROOTS = 8  # addresses whose /config is kept (behind a proxy a server is asked at one or two)


def cache_page_config(gradio_app) -> bool:
    """Replace the /config routes of a mounted Gradio app with ones that make Gradio's answer once
    per root address. False where the routes are not the shape this was written against (the app
    then answers them as Gradio does)."""
    import threading

    from fastapi.routing import APIRoute
    from gradio import route_utils

    routes = gradio_app.router.routes
    found = [i for i, r in enumerate(routes) if isinstance(r, APIRoute) and r.path in ("/config", "/config/")
             and r.methods == {"GET"}]
    if not found:
        return _decline("cache_page_config", "the Gradio app has no GET /config route")
    original = routes[found[0]].endpoint
    if getattr(original, "__lmscope_cached__", False):
        return True
    if params(original) != PARAMS["/config"] or any(routes[i].endpoint is not original for i in found):
        return _decline("cache_page_config", f"/config's endpoint does not take {PARAMS['/config']}, "
                        "or /config and /config/ have different endpoints")
    if params(route_utils.get_root_url) != PARAMS["route_utils.get_root_url"]:
        return _decline("cache_page_config", "route_utils.get_root_url does not take "
                        f"{PARAMS['route_utils.get_root_url']}")
    cache: dict[tuple, tuple[type, dict]] = {}
    lock = threading.Lock()

    @functools.wraps(original)  # FastAPI reads the parameters (and the user dependency) through this
    def get_config(request, user=None, deep_link: str = "", page=None):
        if deep_link or page is not None:
            return original(request=request, user=user, deep_link=deep_link, page=page)
        blocks = gradio_app.get_blocks()
        # the root Gradio puts into the copy, worked out as Gradio's get_config does
        root = route_utils.get_root_url(request=request, route_path="/config",
                                        root_path=gradio_app.root_path or request.scope.get("root_path")
                                        or blocks.custom_mount_path)
        key = (root, id(blocks.config))
        with lock:
            kept = cache.get(key)
        if kept is None:
            import orjson

            answer = original(request=request, user=None, deep_link="", page=None)
            kept = (type(answer), orjson.loads(answer.body))
            with lock:
                if len(cache) >= CONFIG_ROOTS:
                    cache.pop(next(iter(cache)))
                cache[key] = kept
        response_class, config = kept
        return response_class(content={**config, "username": user})  # a new top level; the rest is only read

    get_config.__lmscope_cached__ = True
    for i in found:
        r = routes[i]
        routes[i] = APIRoute(r.path, get_config, methods=list(r.methods), dependencies=r.dependencies,
                             name=r.name, include_in_schema=r.include_in_schema, response_class=r.response_class)
    return True
