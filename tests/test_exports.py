"""Issue 15 item 6: the Interventions download's attribution table adds up like the attribution
itself (embedding + every attention and MLP + the final bias = the model's logit; heads = their
layer's attention), from the tab's own callback on a tiny random-weight model."""

import csv

from app import interventions_tab as tab
from app.exports import write_interventions


def test_attribution_csv_adds_up(tmp_path):
    summary, heads_fig, layers_fig, data = tab.run_attribution("random-llama-tiny", "Eiffel is in", "P", "R",
                                                               "logit_diff")
    (path, js) = write_interventions(None, None, data, tmp_path)
    rows = list(csv.DictReader(open(path, encoding="utf-8")))
    parts = [float(r["value"]) for r in rows if r["part"] in ("embedding", "attention", "mlp")]
    assert abs(sum(parts) + data["final_bias"] - data["logit"]) < 1e-4, (sum(parts), data)
    for layer in range(3):
        heads = sum(float(r["value"]) for r in rows if r["part"] == "head" and r["layer"] == str(layer))
        attn = next(float(r["value"]) for r in rows if r["part"] == "attention" and r["layer"] == str(layer))
        assert abs(heads - attn) < 1e-4  # bias-free: the heads add up to their layer
    assert len([r for r in rows if r["part"] == "head"]) == 3 * 4 and js.name == "results.json"
