"""The page's events as an API: which are public (stable names, documented in the README), and the
hardening every event gets whether public or not (a hand-made request can reach any of them by
its fn_index, so "private" hides an event from the API docs, not from an attacker).

- PUBLIC_API: the one list of public endpoint names; everything else is made private. A test
  checks it against the README's table and against what `gradio_client.view_api()` shows.
- harden(demo): every input component answers a wrong-typed value with one sentence naming the
  setting (not Gradio's "Could not preprocess input component at index 4 ..."), and any failure
  inside Gradio's own processing becomes one sentence without paths or URLs.
- limit_queue_share(demo, share): no user holds more than `share` places in the shared queue.
"""

from __future__ import annotations

import logging
import re

import gradio as gr
from gradio.exceptions import ComponentProcessingError, InvalidPathError
from pydantic import ValidationError

from app.shared.context import echo, one_sentence, quiet_error

log = logging.getLogger(__name__)

# name -> what it does. The README's "Public API" table lists exactly these.
PUBLIC_API: dict[str, str] = {
    "trace": "Explore: trace a prompt; tokens, attention, logit lens, neurons, next-token distribution",
    "model_info": "One line about a model: size, layers, heads, device",
    "generate": "Generate token by token (streams); every step's candidates and filters",
    "sample": "N samples of the same prompt with consecutive seeds",
    "speculative": "Greedy speculative decoding (prompt lookup or a cut draft) beside plain greedy: kept and "
                   "rejected proposals per target forward",
    "steer": "A steering vector from contrastive pairs: the steered and the unsteered generation, same seed",
    "ablate": "Ablate heads, MLP layers or neurons on the clean prompt",
    "patch": "Activation patching sweep, clean into corrupted",
    "attribute": "Direct logit attribution per layer and head",
    "compare_prompts": "Two prompts side by side",
    "anatomy_card": "Architecture card (and a comparison with other models)",
    "anatomy_tree": "Module tree with tensor shapes",
    "anatomy_attention": "Attention step by step for one layer and head",
    "anatomy_rope": "RoPE rotation angles",
    "anatomy_positions": "Position encodings",
    "anatomy_norm": "Normalisation step by step",
    "anatomy_mlp": "MLP step by step",
    "anatomy_output": "Output layer: final norm, unembedding, softmax",
    "anatomy_embeddings": "Embedding neighbours and analogies",
    "jobs_list": "Your background jobs (everyone's with sign-in off)",
    "jobs_submit_tokenizer": "Queue a tokenizer-training job",
    "jobs_submit_sft": "Queue a supervised fine-tuning job",
    "jobs_submit_patching": "Queue an activation-patching sweep as a background job",
    "tokenize": "The prompt tokenized by the default model and finished tokenizer jobs",
    "loss_mask": "Which tokens of an SFT training example count in the loss",
    "compare_models": "One prompt through a fine-tuned model and its base",
    "compare_runs": "Several fine-tuning runs: loss curves overlaid, settings and results side by side",
    "generate_both": "The same prompt, greedy, through a fine-tuned model and its base",
    "weight_change": "Per layer and module, how far a fine-tuned model's weights moved from its base's",
}

# What a component's value must be, for the one-sentence answer to a wrong-typed one.
_EXPECTED = {"Number": "a number", "Slider": "a number", "Checkbox": "true or false", "Textbox": "text",
             "Dropdown": "one of its choices", "Radio": "one of its choices", "File": "an uploaded file",
             "CheckboxGroup": "a list of its choices"}


def _with_defaults(values: list, blocks: list) -> list | None:
    """`values` with the missing trailing inputs set to their controls' defaults, where each of those
    is a number or checkbox control with a plain default (settings appended to an endpoint); else None."""
    tail = blocks[len(values):]
    if not all(isinstance(b, (gr.Slider, gr.Number, gr.Checkbox)) and _scalar(b.value) for b in tail):
        return None
    return [*values, *(b.value for b in tail)]


def _label(block) -> str:
    return str(getattr(block, "label", None) or getattr(block, "elem_id", None) or type(block).__name__)


def _scalar(v) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _guard_preprocess(block) -> None:
    original = block.preprocess
    expected = _EXPECTED.get(type(block).__name__, "a valid value")

    def preprocess(payload):
        try:
            return original(payload)
        except Exception:  # noqa: BLE001 - whatever Gradio raised, the user gets the setting's name
            got = f"; got {one_sentence(ValueError(echo(repr(payload), 40)))}" if _scalar(payload) else ""
            raise quiet_error(f"'{echo(_label(block), 40)}' must be {expected}{got}.") from None

    block.preprocess = preprocess


def harden(demo: gr.Blocks) -> None:
    """Make unnamed events private, check every public name exists, guard every input component,
    and turn failures inside Gradio's processing into one sentence. Call once, after the layout."""
    names = set()
    for fn in demo.fns.values():
        if fn.api_name in PUBLIC_API:
            fn.api_visibility = "public"
            fn.api_description = PUBLIC_API[fn.api_name]
            names.add(fn.api_name)
        else:
            fn.api_visibility = "private"
    missing = set(PUBLIC_API) - names
    if missing:
        raise RuntimeError(f"public API names with no event: {sorted(missing)}")
    inputs = {id(b): b for fn in demo.fns.values() for b in fn.inputs}
    for block in inputs.values():
        if isinstance(block, gr.components.Component) and not block.stateful:
            _guard_preprocess(block)

    original = demo.process_api

    async def process_api(*args, **kwargs):
        block_fn = kwargs.get("block_fn", args[0] if args else None)
        inputs = kwargs.get("inputs", args[1] if len(args) > 1 else None)
        fn = demo.fns[block_fn] if isinstance(block_fn, int) else block_fn
        first_call = kwargs.get("iterator") is None  # a streaming event calls again for each chunk
        if first_call and isinstance(inputs, list) and len(inputs) < len(fn.inputs):
            # a setting appended to an endpoint later (Generate's penalties) takes its control's default
            # when an older client leaves it out; nothing else is filled in
            filled = _with_defaults(inputs, fn.inputs)
            if filled is not None:
                inputs = filled
                if "inputs" in kwargs:
                    kwargs["inputs"] = filled
                else:
                    args = (args[0], filled, *args[2:])
        if first_call and (not isinstance(inputs, list) or len(inputs) < len(fn.inputs)):
            got = len(inputs) if isinstance(inputs, list) else type(inputs).__name__
            raise quiet_error(f"This endpoint takes {len(fn.inputs)} values; the request sent {got}.")
        try:
            return await original(*args, **kwargs)
        except gr.Error as e:
            e.print_exception = False
            raise
        except ComponentProcessingError as e:
            # a component copied into the session (after a gr.update) has Gradio's own preprocess:
            # name the setting from the index Gradio reports
            m = re.search(r"input component at index (\d+)", str(e))
            block = fn.inputs[int(m.group(1))] if m and int(m.group(1)) < len(fn.inputs) else None
            what = _EXPECTED.get(type(block).__name__, "a valid value")
            raise quiet_error(f"'{echo(_label(block), 40)}' must be {what}." if block is not None
                              else "An input has the wrong type for this endpoint.") from None
        except InvalidPathError:  # a file path the request made up: Gradio refused to read it
            raise quiet_error("Only files uploaded through this page are accepted.") from None
        except ValidationError:  # Gradio validates file payloads with pydantic: ours are the only ones
            raise quiet_error("A file input got something that is not a file uploaded through this page.") from None
        except Exception as e:  # noqa: BLE001 - Gradio's own pre/postprocessing; the callbacks map theirs
            log.error("request to %s failed in processing", fn.name, exc_info=e)
            raise quiet_error(f"The request could not be processed: {one_sentence(e)}") from None

    demo.process_api = process_api


def user_of(event) -> str:
    return getattr(event, "username", None) or getattr(event, "session_hash", None) or "anonymous"


def limit_queue_share(demo: gr.Blocks, share: int) -> None:
    """One user (the signed-in name; the browser session with sign-in off) may have at most `share`
    events waiting or running in the shared queue; more are refused with one sentence, so one
    account's burst cannot fill the queue for everyone. Call after demo.queue()."""
    queue = demo._queue
    original = queue.push

    async def push(body, request, username):
        key = username or getattr(body, "session_hash", None) or "anonymous"
        held = sum(1 for e in list(queue.event_ids_to_events.values()) if user_of(e) == key)
        if held >= share:
            return (False, f"You have {held} requests waiting or running (the limit is {share}); "
                           "wait for some to finish.", "queue_full")
        return await original(body=body, request=request, username=username)

    queue.push = push
