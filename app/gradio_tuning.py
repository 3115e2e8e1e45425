"""Two places where Gradio's own work held the interpreter that the engine thread needs.

Both were found with py-spy during a streamed generation (docs/PERFORMANCE.md): the engine thread
runs ~1,500 torch calls a token and takes the GIL back after each, so any Python the event loop
runs meanwhile is a token's time lost.

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
"""

from __future__ import annotations

import copy
import functools
import inspect

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
        return False
    for name, value in names.items():
        setattr(queue, name, max(getattr(queue, name), value))
    return True


def skip_unchanged_outputs() -> bool:
    """Patch gradio.Blocks.postprocess_data once. False where Gradio's method is not the shape this
    was written against (the app then runs on Gradio's own path)."""
    from gradio.blocks import Block, Blocks, convert_component_dict_to_list

    original = Blocks.postprocess_data
    if getattr(original, "__lmscope_skips__", False):
        return True
    if list(inspect.signature(original).parameters) != ["self", "block_fn", "predictions", "state"] \
            or not inspect.iscoroutinefunction(original):
        return False

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
