"""A link to the Generate tab: its settings are clamped into their controls, and a link to another
tab runs nothing (issue 15 item 10)."""


def test_generate_settings_from_a_link_are_clamped_into_their_controls():
    from app.tabs.generate.tab import settings_from_url

    q = {"tab": "generate", "prompt": "Hi", "gen_max": "99999", "gen_t": "50", "gen_k": "-3", "gen_p": "0",
         "gen_minp": "nan", "gen_rep": "1.2", "gen_seed": "7", "gen_step": "4", "gen_stop": "\\n"}
    got = settings_from_url(q, 256)
    assert (got["gen_max"], got["gen_t"], got["gen_p"], got["gen_minp"], got["gen_rep"]) == (256, 2.0, 0.01, 0.0, 1.2)
    assert got["gen_k"] == -3  # kept as written: the run says so beside top-k instead of running
    assert (got["gen_seed"], got["gen_step"], got["prompt"], got["gen_stop"]) == (7, 4, "Hi", "\\n")
    # the penalties: absent -> off; out of the sliders' range -> clamped into it; not a number -> off
    assert (got["gen_pres"], got["gen_freq"]) == (0.0, 0.0)
    got = settings_from_url({**q, "gen_pres": "9", "gen_freq": "inf"}, 256)
    assert (got["gen_pres"], got["gen_freq"]) == (2.0, 2.0)
    got = settings_from_url({**q, "gen_pres": "-0.5", "gen_freq": "x"}, 256)
    assert (got["gen_pres"], got["gen_freq"]) == (-0.5, 0.0)
    # a link to another tab (as the page read it before its first tab rewrote the URL) runs nothing
    assert settings_from_url(q, 256, opened_tab="explore") is None
    assert settings_from_url({"tab": "generate"}, 256) is None
    assert settings_from_url({**q, "tab": "explore"}, 256, opened_tab="generate") is not None
