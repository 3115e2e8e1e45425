"""The table downloads wired into Generate (samples) and Fine-tune (runs): what the handlers write is
the table as the page shows it, and a click before there is anything says so in one sentence.
(The Jobs list download is checked per viewer in tests/integration/test_job_ownership.py.)"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import gradio as gr
import pytest

from app.tabs.finetune import tab as sft_tab
from app.tabs.generate.tab import GenerateTab

TABLE = [[7, " Paris, the capital", 4, 0.61, "length"], [8, " a city in France", 4, 0.42, "length"],
         ["", "2 distinct texts out of 2", "", "", ""]]


def test_samples_download_is_the_table_shown():
    out = GenerateTab.export_samples(None, TABLE, "smollm2-135m-instruct", "The capital of France is")
    files = {Path(f).name: Path(f) for f in out["value"]}
    rows = list(csv.DictReader(files["samples.csv"].open()))
    assert [(int(r["seed"]), r["text"], int(r["tokens"]), float(r["mean_p"])) for r in rows] == \
        [(7, " Paris, the capital", 4, 0.61), (8, " a city in France", 4, 0.42)]
    data = json.loads(files["samples.json"].read_text())
    assert data["summary"] == "2 distinct texts out of 2" and data["prompt"] == "The capital of France is"
    assert [s["seed"] for s in data["samples"]] == [7, 8]


@pytest.mark.parametrize("table", [None, [], [["", "0 distinct texts out of 0", "", "", ""]], "x" * 50,
                                   [["x", "text", "y", "z", "w"]], {"data": 3}])
def test_samples_download_before_any_sample_says_so(table):
    with pytest.raises(gr.Error, match="Draw some samples first"):
        GenerateTab.export_samples(None, table, None, None)


def test_runs_download_before_choosing_runs_says_so():
    with pytest.raises(gr.Error, match="Choose the runs"):
        sft_tab.export_runs([], None)
    with pytest.raises(gr.Error, match="Choose the runs"):
        sft_tab.export_runs(["../../etc/passwd", 3, None], None)  # unknown ids are no runs
