"""Generate's pure figures (app/tabs/generate/figures.py): the chosen token is in its step's charts
even past the recorded top 10 (issue 37 item 6), and the beam tree's text fits (item 9). The step
below is the shape of model_core.serving.generation_records.step_to_json; the rank-16 case is the
one seen on the default model (seed 2, temperature 1, "Once upon a time, in a small village,": step 3,
rank 16, p = 0.014, checked by tests/reference in /tmp/find_rank.py's run)."""

from pathlib import Path

from app.tabs.generate import figures as F


def _step(rank: int) -> dict:
    top = [{"id": 100 + i, "token": f"t{i}", "prob": 0.5 / (i + 1), "removed_by": None} for i in range(10)]
    after = [{"id": 100 + i, "token": f"t{i}", "prob": 0.5 / (i + 1)} for i in range(10)]
    chosen_id = 100 + rank - 1 if rank <= 10 else 999
    return {"index": 3, "position": 12, "entropy": 3.0, "entropy_filtered": 3.0, "n_candidates": 49152,
            "chosen": {"id": chosen_id, "token": " wizard", "display": " wizard", "prob": 0.014,
                       "prob_filtered": 0.014, "rank": rank},
            "top_before": top, "top_after": after, "removed": {}}


def test_a_chosen_token_past_the_top_10_gets_its_own_marked_bar_in_both_charts():
    fig = F.distribution_figure(_step(16))
    before, after = fig.data[0], fig.data[1]
    assert len(before.y) == 11 and len(after.y) == 11  # the top 10 and the chosen token
    # drawn last (bottom of a horizontal bar chart), its rank in the label, its own colour
    for bars in (before, after):
        assert "(rank 16)" in bars.y[0] and "★" in bars.y[0] and "999" in bars.y[0]
        assert bars.x[0] == 0.014
        assert bars.marker.color[0] == F.CHOSEN_EXTRA_COLOUR
        assert list(bars.marker.color[1:]).count(F.CHOSEN_EXTRA_COLOUR) == 0


def test_a_chosen_token_in_the_top_10_is_not_drawn_twice():
    fig = F.distribution_figure(_step(2))
    assert len(fig.data[0].y) == 10 and len(fig.data[1].y) == 10
    assert sum("★" in y for y in fig.data[0].y) == 1


def _beams(groups: bool = False) -> list[dict]:
    toks = [" extraordinarily", " long", " words", " here"]
    return [{"rank": r + 1, "tokens": toks, "token_ids": [r, 1, 2, 3], "step_logprobs": [-1.0] * 4,
             "score": -1.2345, "logprob": -4.0, "eos": False, **({"group": r // 2} if groups else {})}
            for r in range(4)]


def test_beam_tree_labels_are_short_and_the_colour_bar_clears_the_score_notes():
    fig = F.beam_tree_figure(_beams(groups=True))
    nodes = fig.data[1]
    assert all(len(t) <= F.BEAM_TOKEN_CHARS for t in nodes.text)  # the whole token is on hover
    assert any("extraordinarily" in h for h in nodes.hovertext)
    # neighbouring steps' labels on opposite sides of their nodes
    pos = dict(zip(nodes.x, nodes.textposition))
    assert pos[1] != pos[2]
    notes = fig.layout.annotations
    assert all(len(a.text) <= 12 for a in notes) and all("score" in a.hovertext for a in notes)
    assert all("group" in a.hovertext for a in notes)
    # the colour bar starts right of the plot area plus its pad, inside the right margin the notes use
    bar = nodes.marker.colorbar
    assert bar.x >= 1.0 and bar.xanchor == "left" and bar.xpad >= 60
    assert fig.layout.margin.r >= bar.xpad + 40


def test_table_headers_keep_whole_words():
    css = (Path(__file__).resolve().parents[2] / "static" / "generate.css").read_text()
    for table in ("#gen-steer-table th", "#gen-search-table th"):
        assert table in css
    assert "word-break: keep-all" in css and "white-space: nowrap" in css
