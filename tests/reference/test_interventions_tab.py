"""The Interventions tab's callbacks on the real default model (issue 15 item 10): a target typed
without its leading space is named with the token it became and the spaced one offered, and a link's
heads and MLP layers are kept only where the default model (SmolLM2: 30 layers, 9 heads) has them."""

from conftest import DEFAULT


def test_a_target_without_its_leading_space_is_named_and_the_spaced_one_offered():
    """On the real default tokenizer: 'Paris' is token 38634, ' Paris' (what the model writes after
    'city of') is 7042; the note says both and the button puts the space in."""
    from transformers import AutoTokenizer

    from app.tabs.interventions import tab as iv
    from model_core.core.registry import converted_dir

    tok = AutoTokenizer.from_pretrained(str(converted_dir(DEFAULT)))
    paris, spaced = tok.encode("Paris", add_special_tokens=False), tok.encode(" Paris", add_special_tokens=False)
    assert len(paris) == len(spaced) == 1 and paris != spaced
    note, fix = iv.space_note(DEFAULT, "Paris", " Rome", "logit_diff")
    assert note["visible"] and fix["visible"] and fix["value"] == "Use ' Paris'"
    assert f"id {paris[0]}" in note["value"] and f"id {spaced[0]}" in note["value"] and "“␣Paris”" in note["value"]
    note, fix = iv.space_note(DEFAULT, "Paris", "Rome", "logit_diff")
    assert fix["value"] == "Use ' Paris' and ' Rome'"
    target, other, note, fix = iv.use_spaced(DEFAULT, "Paris", "Rome", "logit_diff")
    assert (target, other) == (" Paris", " Rome") and not note["visible"]
    # already spaced, an id, or "other" unused by the log-prob metric: nothing to say
    assert not iv.space_note(DEFAULT, " Paris", " Rome", "logit_diff")[0]["visible"]
    assert not iv.space_note(DEFAULT, "7042", "Rome", "logprob")[0]["visible"]


def test_interventions_choices_from_a_link_are_valid_values():
    import gradio as gr

    from app.tabs.interventions.tab import choices_from_url

    q = {"tab": "interventions", "iv_clean": "A", "iv_target": " Paris", "iv_metric": "logprob",
         "iv_heads": "L0H1,L99H0,L3H2,../x", "iv_mlps": "2,40", "iv_mode": "evil", "iv_align": "1"}
    got = choices_from_url(q, None)
    assert got["iv_heads"] == ["L0H1", "L3H2"] and got["iv_mlps"] == ["2"]  # SmolLM2: 30 layers, 9 heads
    assert got["iv_metric"] == "logprob" and got["iv_align"] is True and got["iv_target"] == " Paris"
    assert got["iv_mode"] == gr.skip() and got["iv_corrupt"] == gr.skip()
    assert choices_from_url(q, "explore") is None and choices_from_url({"tab": "interventions"}, None) is None
