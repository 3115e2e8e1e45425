"""The prompt's caps in the user's terms (issue 37 item 3): a text over the character cap gets one
sentence in characters and tokens, never a setting's variable name; a callback that caps its prompt
itself (Explore's run: a sentence under the prompt, or truncation) is let through the endpoint's
generic cap for that parameter only; the line under the prompt counts characters and, once run, tokens."""

import gradio as gr
import pytest


@pytest.fixture
def cap_100(monkeypatch):
    monkeypatch.setenv("LMSCOPE_MAX_PROMPT_TOKENS", "100")  # 100 tokens -> 1,600 characters (x16)


def test_the_generic_cap_speaks_characters_and_tokens(cap_100):
    from app.shared import context

    @context.endpoint
    def echo_len(text):
        return len(text)

    with pytest.raises(gr.Error) as e:
        echo_len("x" * 1601)
    assert e.value.message == "That text is 1,601 characters; this server takes at most 1,600 characters (100 tokens)."
    assert "LMSCOPE" not in e.value.message


def test_long_text_is_left_to_the_callback_for_that_parameter_only(cap_100):
    from app.shared import context

    @context.endpoint(long_text=("prompt",))
    def run(model, prompt, other=""):
        return context.text_too_long(prompt) or len(prompt)

    assert run("m", "x" * 1600) == 1600
    said = run("m", "x" * 20_000)  # positional
    assert said == ("The prompt is 20,000 characters; this server takes at most 1,600 characters (100 tokens). "
                    "Shorten it, or tick Truncate to keep its end.")
    assert run("m", prompt="x" * 20_000).startswith("The prompt is 20,000")  # by name
    with pytest.raises(gr.Error, match="1,601 characters"):  # another text of the same call is still capped
        run("m", "x", "y" * 1601)
    with pytest.raises(TypeError):  # a misspelt name fails when the page is built, not in a request
        context.endpoint(long_text=("promt",))(lambda prompt: prompt)


def test_the_line_under_the_prompt(cap_100):
    from app.server.page import prompt_count_html

    line = prompt_count_html("é" * 1601)  # characters are code points, as the page's script counts them
    assert "1,601 characters, over this server&#x27;s 1,600" in line and 'data-cap="1600"' in line
    assert prompt_count_html("hello", {"key": "gone", "prompt": "hello"}).endswith('id="prompt-tokens"></span>')  # no trace: no tokens
