"""A depth sweep at equal non-embedding parameters (model_core/training/pretrain.py depth_shapes,
tasks/pretrain_job.py): the shape chosen per depth, counted from real built models; its params,
refusals and model names; and its figure. No worker: tests/integration/test_pretrain.py runs one."""

from __future__ import annotations

import pytest
import torch

from model_core.core.errors import LmscopeError
from model_core.training import pretrain as pt
from tasks import pretrain_job as pj


def _built_count(width: int, layers: int) -> int:
    """Non-embedding parameters of the real fp32 model run_pretrain would train."""
    s = pt.validate_settings({"width": width, "layers": layers, "context": 16}, any_width=True)
    model, _ = pt.build_model(s)
    return pt.param_counts(model)["non_embedding"]


@pytest.mark.parametrize("target, depths", [(pt.shape_params(128, 2), [1, 2, 4, 8]),
                                            (1_000_000, [1, 2, 3, 6, 12])])
def test_each_depth_gets_the_width_of_equal_counted_params(target, depths):
    shapes = pt.depth_shapes(depths, target)
    assert [s["layers"] for s in shapes] == depths
    counts = []
    for s in shapes:
        n = _built_count(s["width"], s["layers"])
        assert n == s["n_non_embedding"], s  # the meta-device count is the real model's
        counts.append(n)
        # the closest buildable width: its neighbours on either side are further from the target
        ws = pt.shape_widths()
        i = ws.index(s["width"])
        for j in (i - 1, i + 1):
            if 0 <= j < len(ws):
                assert abs(pt.shape_params(ws[j], s["layers"]) - target) >= abs(n - target)
    assert all(abs(n - target) / target < 0.07 for n in counts), (counts, target)
    assert (max(counts) - min(counts)) / target < 0.1, counts
    # deeper is narrower at equal N
    widths = [s["width"] for s in shapes]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)


def test_chosen_widths_build_and_run():
    """Widths that are not multiples of 16 still split into whole heads of an even size (RoPE)."""
    for s in pt.depth_shapes([1, 3, 5], 300_000):
        cfg = pt.make_config(s["width"], s["layers"], 16)
        assert cfg.num_attention_heads * cfg.head_dim == s["width"] and cfg.head_dim % 2 == 0
        model, _ = pt.build_model(pt.validate_settings({"width": s["width"], "layers": s["layers"], "context": 16},
                                                       any_width=True))
        with torch.no_grad():
            out = model(input_ids=torch.arange(8).unsqueeze(0)).logits
        assert out.shape == (1, 8, 258) and torch.isfinite(out).all()


def test_param_counts_on_meta_match_real_models():
    for w, layers in ((32, 1), (96, 3), (256, 2)):
        assert pt.shape_params(w, layers) == _built_count(w, layers)


def test_depth_sweep_params_and_names():
    v = pj.validate_params("scaling", {"depths": "4, 1,2", "width": 64, "layers": 2, "tokens": 4096})
    assert v["depths"] == [1, 2, 4] and v["params"] == pt.shape_params(64, 2)
    assert [(s["layers"], s["width"]) for s in v["shapes"]][1] == (2, 64)  # the reference shape itself
    names = pj.model_names("scaling", {**v, "output_name": "deep", "keep_checkpoints": 2})
    finals = [n for n in names if "-step" not in n]
    assert finals == [f"deep-L{s['layers']}-d{s['width']}" for s in v["shapes"]]
    assert len(set(names)) == len(names) == 9
    # --params wins the target; a width sweep stays as it was
    v = pj.validate_params("scaling", {"depths": [2, 6], "params": 250_000})
    assert all(abs(s["n_non_embedding"] - 250_000) < 0.07 * 250_000 for s in v["shapes"])
    w = pj.validate_params("scaling", {"widths": "32,64", "tokens": 4096})
    assert w["widths"] == [32, 64] and "depths" not in w and "shapes" not in w


@pytest.mark.parametrize("params, words", [
    ({"depths": "4"}, "at least two different depths"),
    ({"depths": "0,2"}, "Depths must be whole numbers from 1 to 12"),
    ({"depths": "2,13"}, "Depths must be whole numbers from 1 to 12"),
    ({"depths": "1,2,4,8", "params": 5000}, "too few for 8 layers"),
    ({"depths": "1,2", "params": 50_000_000}, "too many for 1 layer"),
    ({"depths": "1,2", "widths": "32,64"}, "either widths or depths"),
    ({"widths": "32,64", "params": 100_000}, "'params' belongs to a depth sweep"),
    ({"depths": "1,2", "params": 100_000, "width": 64}, "either 'params' or a 'width'"),
    ({"widths": "64,112"}, "Width 112 does not split into 3 heads"),
])
def test_bad_depth_sweeps_are_one_sentence(params, words):
    with pytest.raises(LmscopeError) as e:
        pj.validate_params("scaling", params)
    msg = str(e.value)
    assert words in msg and msg.endswith(".") and "\n" not in msg, msg


def test_depth_figure_labels_width_and_counted_params():
    from app.tabs.finetune import pretrain_figures as pf

    pts = [{"layers": 1, "width": 180, "n_non_embedding": 389_340, "n_total": 435_780, "final_eval_loss": 2.5,
            "model_name": "deep-L1-d180"},
           {"layers": 4, "width": 92, "n_non_embedding": 418_876, "n_total": 442_612, "final_eval_loss": 2.4,
            "model_name": "deep-L4-d92"}]
    rec = {"kind": "scaling", "params": {"depths": [1, 4], "params": 402_048, "tokens": 4096},
           "pretrain": {"points": pts, "fit": None}}
    fig = pf.sweep_figure(rec)
    [tr] = fig.data
    assert list(tr.x) == [1, 4] and list(tr.y) == [2.5, 2.4]
    assert list(tr.text) == ["d=180, N=389k", "d=92, N=419k"]
    assert [list(c[:2]) for c in tr.customdata] == [[180, 389_340], [92, 418_876]]
    assert "no L(N) fit" in fig.layout.title.text
    md = pf.status_markdown({**rec, "state": "succeeded", "params": {**rec["params"], "shapes": [
        {"layers": 1, "width": 180}, {"layers": 4, "width": 92}]}})
    assert "nothing to fit" in md and "`deep-L4-d92`" in md
    # a width sweep's record still gets the L(N) plot
    w = pf.sweep_figure({"kind": "scaling", "params": {"widths": [64, 128], "tokens": 4096},
                         "pretrain": {"points": [{**pts[0], "width": 64}, {**pts[1], "width": 128}], "fit": None}})
    assert "L(N)" in w.layout.title.text
