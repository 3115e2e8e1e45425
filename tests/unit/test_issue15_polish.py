"""Issue 15 item 10, the polish users hit: the Jobs ETA says nothing until it can say something
true, a finished job has no cancel button, a target typed without its leading space says which
token it became and offers the spaced one."""

import time

from app.shared import job_views as jf


def _rec(state="running", fraction=0.05, eta=0.2, started_ago=1.0):
    now = time.time()
    return {"id": "j1", "kind": "tokenizer", "state": state, "started": now - started_ago, "created": now - 2,
            "progress": {"fraction": fraction, "stage": "training", "eta_seconds": eta}, "params": {}}


def test_eta_is_said_only_when_it_means_something():
    # the old panel said "about 0 s left" at 5%, one second in
    assert jf.eta_text(_rec()) == "" and "left" not in jf.progress_html(_rec())
    assert jf.eta_text(_rec(fraction=0.5, eta=3.0, started_ago=3.0)) == ""  # too soon after the start
    assert jf.eta_text(_rec(fraction=0.5, eta=3.0, started_ago=10)) == "a few seconds left"
    assert jf.eta_text(_rec(fraction=0.4, eta=42, started_ago=30)) == "about 40 s left"
    assert jf.eta_text(_rec(fraction=0.2, eta=600, started_ago=150)) == "about 10 min left"
    assert "about 40 s left" in jf.progress_html(_rec(fraction=0.4, eta=42, started_ago=30))
    assert jf.eta_text(_rec(state="succeeded", fraction=1.0, eta=0, started_ago=30)) == ""
    table = jf.jobs_table([_rec(), _rec(fraction=0.4, eta=42, started_ago=30)])
    assert list(table["eta"]) == ["", "about 40 s"]


def test_cancel_button_only_while_a_job_can_stop():
    from app.tabs.jobs.tab import _cancel_button

    for state, shown in [("queued", True), ("running", True), ("succeeded", False), ("failed", False),
                         ("cancelled", False)]:
        assert _cancel_button(jf.progress_html(_rec(state=state)))["visible"] is shown, state
    assert _cancel_button(jf.progress_html(None))["visible"] is False


def test_a_target_without_its_leading_space_is_named_and_the_spaced_one_offered():
    """On the real default tokenizer: 'Paris' is token 38634, ' Paris' (what the model writes after
    'city of') is 7042; the note says both and the button puts the space in."""
    from transformers import AutoTokenizer

    from app.tabs.interventions import tab as iv
    from conftest import DEFAULT
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


def test_generate_settings_from_a_link_are_clamped_into_their_controls():
    from app.tabs.generate.tab import settings_from_url

    q = {"tab": "generate", "prompt": "Hi", "gen_max": "99999", "gen_t": "50", "gen_k": "-3", "gen_p": "0",
         "gen_minp": "nan", "gen_rep": "1.2", "gen_seed": "7", "gen_step": "4", "gen_stop": "\\n"}
    got = settings_from_url(q, 256)
    assert (got["gen_max"], got["gen_t"], got["gen_p"], got["gen_minp"], got["gen_rep"]) == (256, 2.0, 0.01, 0.0, 1.2)
    assert got["gen_k"] == -3  # kept as written: the run says so beside top-k instead of running
    assert (got["gen_seed"], got["gen_step"], got["prompt"], got["gen_stop"]) == (7, 4, "Hi", "\\n")
    # a link to another tab (as the page read it before its first tab rewrote the URL) runs nothing
    assert settings_from_url(q, 256, opened_tab="explore") is None
    assert settings_from_url({"tab": "generate"}, 256) is None
    assert settings_from_url({**q, "tab": "explore"}, 256, opened_tab="generate") is not None


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
