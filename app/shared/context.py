"""What every tab shares: the global model picker and prompt, and safe model access.

A tab module exposes `build(shared: Shared) -> None`, called inside its `gr.Tab`; it reads the
current model name and prompt from `shared` components as event inputs, and raises `gr.Error`
(via `user_error`) for anything the user can fix.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import gradio as gr

from model_core.core.errors import LmscopeError
from model_core.core.registry import LoadedModel, list_models, load_model
from model_core.core.settings import Settings
from model_core.core.settings import current as current_settings

log = logging.getLogger(__name__)


@dataclass
class Shared:
    model: gr.Dropdown  # value: model name
    prompt: gr.Textbox
    chat: gr.Checkbox  # wrap the prompt in the model's chat template
    page: gr.Blocks | None = None  # for tabs that read the page's URL when it loads (page.load)
    # Model menus kept in step with the registry while the page is open: (dropdown, "all" | "finetuned").
    # A tab appends its own; app/server/page.py refreshes them all from one timer.
    pickers: list = field(default_factory=list)


def settings() -> Settings:
    """This server's settings (model_core.core.settings.current(): read once, again only when the
    environment changed)."""
    return current_settings()


def allowed_models() -> list[str] | None:
    """LMSCOPE_ALLOWED_MODELS (comma-separated) restricts what the server loads; None = registry,
    fine-tuned models and local paths given on the server's command line."""
    allowed = settings().allowed_models
    return list(allowed) if allowed else None


def default_model() -> str:
    return settings().default_model


MAX_MODEL_NAME = 200

# The client of the model process generations run in (model_core/serving/model_process_client.py), set
# by app/server/main.py's serve() when LMSCOPE_MODEL_PROCESS is on or an address; None: in this process.
_model_process = None


def use_model_process(client) -> None:
    global _model_process
    _model_process = client


def model_process():
    return _model_process


def generation_steps(lm: LoadedModel, request):
    """iter_generate(lm, request=request), run in the model process when there is one: the same
    (step, generation) pairs either way, and the same one-sentence errors."""
    if _model_process is None:
        from model_core.serving.generate import iter_generate

        return iter_generate(lm, request=request)
    return _model_process.iter_generate(lm.name, request)


def get_model(name: str) -> LoadedModel:
    """Load a model for a UI request. Only registry names and fine-tuned models: the browser may
    not name arbitrary paths or hub ids (no path traversal, no surprise downloads)."""
    if name is not None and not isinstance(name, str):
        raise gr.Error("The model must be given by its name.")
    name = (name or "").strip() or default_model()
    if len(name) > MAX_MODEL_NAME:
        raise gr.Error(f"Model names are at most {MAX_MODEL_NAME} characters; '{echo(name)}' is not one.")
    allowed = allowed_models()
    if allowed is not None and name not in allowed:
        raise gr.Error(f"Model '{echo(name)}' is not enabled on this server.")
    s = settings()
    try:
        return load_model(name, device=s.device, dtype=s.dtype, allow_paths=False, allow_hub=False)
    except LmscopeError as e:
        raise gr.Error(one_sentence(e)) from None


# ---------------------------------------------------------------------------------------------
# Who is asking, and what they may do. Every value that arrives from the browser is hostile: the
# owner of a job, a file path, a name. The owner is always derived here from the request (the
# signed-in user; one shared "anonymous" owner with sign-in off), never taken as an argument.

import contextlib  # noqa: E402
import functools  # noqa: E402
import inspect  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ANONYMOUS = "anonymous"  # every browser user with sign-in off: there is no identity to tell them apart
LOCAL = "local"  # a direct Python call (tests, scripts): no request at all
CHARS_PER_TOKEN_CAP = 16  # text is measured in characters before tokenizing: 1,024 tokens -> 16,384 characters
MAX_LIST_ITEMS = 4096  # multiselect values, uploaded files, ...
ECHO_CHARS = 60  # a value quoted back in an error message is cut to this


def max_prompt_tokens() -> int:
    return settings().max_prompt_tokens


def max_text_chars() -> int:
    return max_prompt_tokens() * CHARS_PER_TOKEN_CAP


def generate_concurrency() -> int:
    """Generations streaming at once (their decode steps are batched together, so many are cheap)."""
    return settings().generate_concurrency


def auth_on() -> bool:
    return settings().auth_on


def signed_in_user(request: gr.Request | None) -> str | None:
    """The name Gradio's sign-in attached to this request's session cookie; None with sign-in off."""
    return getattr(request, "username", None) or None if request is not None else None


def who(request: gr.Request | None) -> str | None:
    """Who is asking, the one answer every other question here builds on: the signed-in user's
    name; None when there is no identity (sign-in off, or no request: a direct Python call). With
    sign-in on a request without a user cannot come through Gradio's sign-in: refused, not guessed."""
    user = signed_in_user(request)
    if user is None and request is not None and auth_on():
        raise gr.Error("Sign in first.")
    return user


def job_owner(request: gr.Request | None) -> str:
    """Whose name a new job is recorded under: the user; `local` for a direct Python call,
    `anonymous` for every browser with sign-in off."""
    return who(request) or (LOCAL if request is None else ANONYMOUS)


def job_viewer(request: gr.Request | None) -> str | None:
    """The owner every job read, cancel and download is checked against: the signed-in user; None
    (everyone's jobs) with sign-in off, where there is no identity to check."""
    return who(request)


def user_key(request: gr.Request | None) -> str:
    """Whose request slots a request uses: the signed-in name, else the browser session (sign-in
    off: a per-tab guess, the best there is)."""
    if request is None:
        return LOCAL
    return who(request) or getattr(request, "session_hash", None) or ANONYMOUS


def echo(value, limit: int = ECHO_CHARS) -> str:
    """A value quoted back to the user, cut short: a 5,000-character name is not repeated in full."""
    s = str(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"


_RUNNING: dict[str, int] = {}
_RUNNING_LOCK = threading.Condition()
# A page fires several panels at once: they wait this long for one of the user's slots. Bounded,
# because a waiting request holds a place of its concurrency group (tests/browser/test_safe_to_host.py).
SLOT_WAIT_S = 10.0


@contextlib.contextmanager
def user_slot(request: gr.Request | None, wait_s: float | None = None):
    """Hold one of the user's LMSCOPE_MAX_CONCURRENT_PER_USER model slots (released on return, on
    error, and when a streaming client goes away). A request that finds them all taken waits up to
    `wait_s` for one, then gets one sentence."""
    key, limit = user_key(request), settings().max_concurrent_per_user
    wait_s = SLOT_WAIT_S if wait_s is None else wait_s
    with _RUNNING_LOCK:
        if not _RUNNING_LOCK.wait_for(lambda: _RUNNING.get(key, 0) < limit, timeout=wait_s):
            raise gr.Error(f"You already have {limit} requests running; wait for one to finish.")
        _RUNNING[key] = _RUNNING.get(key, 0) + 1
    try:
        yield
    finally:
        with _RUNNING_LOCK:
            _RUNNING[key] -= 1
            if not _RUNNING[key]:
                del _RUNNING[key]
            _RUNNING_LOCK.notify_all()


def requests_running() -> bool:
    """True while any request holds a model slot (for background work that waits for an idle
    server: app/tabs/explore/lens_filler.py). Read without the lock: a glance, not a reservation."""
    return bool(_RUNNING)


def check_inputs(values) -> None:
    """Every text from the browser is capped in characters before anything tokenizes it, and every
    list in length: one request must not hold a model (or the server's memory) for minutes."""
    cap = max_text_chars()
    for v in values:
        if isinstance(v, str) and len(v) > cap:
            raise gr.Error(f"That text is {len(v):,} characters; this server takes at most {cap:,} "
                           f"characters ({max_prompt_tokens():,} tokens).")
        if isinstance(v, (list, tuple)):
            if len(v) > MAX_LIST_ITEMS:
                raise gr.Error(f"That list has {len(v):,} items; at most {MAX_LIST_ITEMS:,} are accepted.")
            check_inputs([x for x in v if isinstance(x, str)])


_PATHISH = re.compile(r"(?:[A-Za-z]+://\S+)|(?:(?<![\w.])/(?:[\w.@~+-]+/)+[\w.@~+-]*)")


def one_sentence(e: BaseException) -> str:
    """A user-facing message from any exception: its first line, no URLs or server paths, short."""
    text = (str(e).strip().splitlines() or [""])[0]
    text = _PATHISH.sub("…", text)
    return echo(text, 300) if text else type(e).__name__


def _request_of(args, kwargs) -> gr.Request | None:
    r = kwargs.get("request")
    if isinstance(r, gr.Request):
        return r
    return next((a for a in args if isinstance(a, gr.Request)), None)


def _fail(fn, e: Exception):
    """Map an exception from a callback to what the page shows: lmscope's own sentences as they are,
    malformed input as 'Bad input', anything else logged with its traceback and shown as one line."""
    if isinstance(e, gr.Error):
        e.print_exception = False  # a sentence for the user is not a server fault: keep the log for bugs
        return e
    if isinstance(e, LmscopeError):
        return quiet_error(one_sentence(e))
    if isinstance(e, (KeyError, IndexError, ValueError, TypeError)):
        return quiet_error(f"Bad input: {one_sentence(e)}")
    if isinstance(e, RecursionError):  # hostile nesting (JSON "[" x 100,000): the input's fault, not a bug
        return quiet_error("That input is nested too deeply to read; send flat data.")
    log.error("unexpected error in %s", fn.__qualname__, exc_info=e)
    return quiet_error(f"The server could not answer this request ({type(e).__name__}); the error was logged.")


def quiet_error(message: str) -> gr.Error:
    """What the page shows for anything the user can fix; Gradio logs no traceback for it."""
    return gr.Error(message, print_exception=False)


def endpoint(fn=None, *, model: bool = False, long_text: tuple[str, ...] = ()):
    """Every callback the browser can reach goes through this door:
    - text and list inputs are capped before any work (check_inputs); the parameters named in
      `long_text` are left to the callback, which caps them itself and says so where the user
      looks (Explore's prompt: the sentence under the prompt, or truncation), not in a toast;
    - model=True: the request holds one of the user's model slots while it runs (user_slot);
    - every failure becomes one sentence for the page (never a traceback, a URL or a server path).
    A test walks every event of the page and checks each is wrapped (tests/browser/test_safe_to_host.py)."""
    if fn is None:
        return functools.partial(endpoint, model=model, long_text=long_text)
    exempt = _positions(fn, long_text)

    def checked(args, kwargs):
        check_inputs([a for i, a in enumerate(args) if i not in exempt]
                     + [v for k, v in kwargs.items() if k not in long_text])

    def slot(args, kwargs):
        if not model:
            return contextlib.nullcontext()
        _share_the_cores()
        return user_slot(_request_of(args, kwargs))

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                checked(args, kwargs)
                with slot(args, kwargs):
                    yield from fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                raise _fail(fn, e) from None
    else:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                checked(args, kwargs)
                with slot(args, kwargs):
                    return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                raise _fail(fn, e) from None
    wrapper.__lmscope_endpoint__ = {"model": model}
    return wrapper


def _positions(fn, names: tuple[str, ...]) -> set[int]:
    """The positional indexes of fn's parameters called `names`."""
    if not names:
        return set()
    params = list(inspect.signature(fn).parameters)
    missing = [n for n in names if n not in params]
    if missing:
        raise TypeError(f"{fn.__qualname__} has no parameter {missing[0]!r}")
    return {params.index(n) for n in names}


def text_too_long(text: str, what: str = "The prompt") -> str | None:
    """The one sentence for a text over this server's character cap, in the user's terms (None when
    it fits). The cap is counted in characters because it holds before anything tokenizes."""
    cap = max_text_chars()
    if not isinstance(text, str) or len(text) <= cap:
        return None
    return (f"{what} is {len(text):,} characters; this server takes at most {cap:,} characters "
            f"({max_prompt_tokens():,} tokens). Shorten it, or tick Truncate to keep its end.")


def _share_the_cores() -> None:
    """This worker thread's torch work on its share of the cores (model_core.core.cpu_threads)."""
    from model_core.core.cpu_threads import limit_request_thread, request_threads
    from model_core.serving.engine import engine_threads

    limit_request_thread(request_threads(os.cpu_count() or 1, engine_threads(), settings().queue_concurrency))


def guard(fn):
    """An endpoint that touches no model (kept for the tab modules' existing decorators)."""
    return endpoint(fn)


def uploaded_file(f) -> Path:
    """The path of a file this server received through its own upload route, or one sentence.
    Gradio puts uploads in its upload folder; anything else (a path typed into a hand-made
    request, a symlink out of the folder) is refused before anything reads or copies it."""
    from gradio.utils import get_upload_folder

    raw = f if isinstance(f, str) else getattr(f, "path", None) or getattr(f, "name", None)
    if not isinstance(raw, str) or not raw:
        raise gr.Error("That upload is not a file.")
    root = Path(get_upload_folder()).resolve()
    try:
        real = Path(raw).resolve(strict=True)
    except (OSError, RuntimeError):
        raise gr.Error("That upload is not on the server any more; upload it again.") from None
    if not real.is_file() or root not in real.parents:
        raise gr.Error("Only files uploaded through this page are accepted.")
    return real


SCRATCH_KEEP = 16  # newest scratch folders kept per process; older ones are removed


def scratch_dir(kind: str) -> Path:
    """A new folder for files a callback hands to Gradio (which copies them into its own cache).
    All of them live under one per-process folder and only the newest SCRATCH_KEEP stay, so a
    callback called a thousand times leaves sixteen folders behind, not a thousand."""
    import shutil
    import tempfile
    import uuid

    root = Path(tempfile.gettempdir()) / f"lmscope-scratch-{os.getpid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    d = root / f"{time.time_ns():020d}-{kind}-{uuid.uuid4().hex[:8]}"
    d.mkdir(mode=0o700)
    for old in sorted(root.iterdir())[:-SCRATCH_KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return d


# --- the model pickers' choices ---

EXAMPLE_PROMPT = "The animal didn't cross the street because it was too tired"


def model_choices(source: str | None = None) -> list[tuple[str, str]]:
    """(label, name) for every model this server may load; `source` keeps only one kind ("finetuned")."""
    allowed = allowed_models()
    # reward models score responses and have no next-token head: never in a language-model picker
    rows = [r for r in list_models(include_random=True) if (allowed is None or r["name"] in allowed)
            and (source is None or r["source"] == source) and r.get("kind") != "reward"]
    out = []
    for r in rows:
        size = f"{r['parameters'] / 1e6:.0f}M" if r.get("parameters") and r["parameters"] >= 1e6 else (
            f"{r['parameters'] / 1e3:.0f}k" if r.get("parameters") else "?")
        state = "" if r["installed"] else " · not installed"
        out.append((f"{r['name']}  ({r['architecture']}, {size}, {r['source']}{state})", r["name"]))
    return out


def model_names() -> list[str]:
    return [v for _, v in model_choices()]


def finetuned_choices() -> list[tuple[str, str]]:
    return model_choices("finetuned")
