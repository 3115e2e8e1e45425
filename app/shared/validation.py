"""A bad value loses nothing: settings are checked before any work, and the one-sentence message
is shown next to the control that caused it (a small message element under it) while every view
keeps what it showed (the callback answers gr.skip() for them).

    msg = field_message("gen-top-k-msg")          # in the layout, under the control
    settings, problems = check_settings(t, k, p, m, r)
    if problems: return [gr.skip()] * n + [show(problems["top_k"])]
"""

from __future__ import annotations

import gradio as gr

from model_core.core.errors import LmscopeError
from model_core.core.sampling import SamplingSettings

SETTING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def field_message(elem_id: str) -> gr.Markdown:
    """An empty, hidden message line; `show` fills it, `clear` hides it again."""
    return gr.Markdown("", visible=False, elem_id=elem_id, elem_classes=["field-msg"])


def show(text: str | BaseException):
    """A message shown under a control: a sentence, or the exception that says it (gr.Error's str()
    wraps its message in quotes, so its message is read instead)."""
    if isinstance(text, BaseException):
        text = getattr(text, "message", None) or str(text)
    return gr.update(value=f"⚠️ {text}", visible=True)


def clear():
    return gr.update(value="", visible=False)


def check_settings(temperature, top_k, top_p, min_p, repetition_penalty) -> tuple[SamplingSettings, dict[str, str]]:
    """The sampling settings with every bad value replaced by its default, and {field: one sentence}
    for the bad ones (empty when all are fine)."""
    values = dict(zip(SETTING_FIELDS, (temperature, top_k, top_p, min_p, repetition_penalty)))
    problems: dict[str, str] = {}
    for name in SETTING_FIELDS:
        try:
            SamplingSettings.from_values(**{name: values[name]})
        except LmscopeError as e:
            problems[name] = str(e)
            values[name] = None  # from_values: None is the default
    try:
        settings = SamplingSettings.from_values(**values)
    except LmscopeError as e:  # a combination of fine values that is not (none today)
        problems["settings"] = str(e)
        settings = SamplingSettings()
    return settings, problems


def field_of(error: Exception) -> str:
    """Which setting a one-sentence SettingsError names ("top_k must be ..." -> "top_k"), else ""."""
    first = str(error).split(" ", 1)[0]
    return first if first in (*SETTING_FIELDS, "seed", "max_new_tokens") else ""
