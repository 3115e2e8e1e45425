"""Issue 15 item 6: the Interventions download's attribution table adds up like the attribution
itself (embedding + every attention and MLP + the final bias = the model's logit; heads = their
layer's attention), from the tab's own callback on a tiny random-weight model."""

import csv

from app.shared.exports import write_interventions
from app.tabs.interventions import tab


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


# --- the tables of every tab (issue 15 item 6): CSV as shown, JSON with what stands behind it -----

def test_explore_stage_table_download_is_the_table_shown(tmp_path):
    """Explore's 'what each stage did' as stages.csv / stages.json, from the tab's own callbacks on a
    real trace; the reference is model_core.core.sampling.apply_sampling on the trace's next-token logits."""
    import json

    from app.tabs.explore import tab as explore_tab
    from model_core.core.sampling import SamplingSettings, apply_sampling

    out = explore_tab.run_trace("random-llama-tiny", "the quick brown fox", False, False, 0, 0, -1, "probability",
                                0.8, 5, 0.9, 0.0, 1.0)
    state = out[0]
    tr = explore_tab.trace_for_state(state)
    files, msg = explore_tab.export_stages(state, 0.8, 5, 0.9, 0.0, 1.0, 0.0, 0.0)
    paths = [p for p in files["value"]]
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["stages.csv", "stages.json"] and not msg.get("visible")
    rows = list(csv.DictReader(open(paths[0], encoding="utf-8")))
    shown = out[explore_tab.RUN_OUTPUT_NAMES.index("stages")]  # the table the page shows after the run
    assert [[r["stage"], int(r["removed"]), float(r["mass_kept"])] for r in rows] == [list(r) for r in shown]
    ref = apply_sampling(tr.next_logits, SamplingSettings(temperature=0.8, top_k=5, top_p=0.9),
                         context_ids=tr.token_ids)
    assert [(r["stage"], int(r["removed"])) for r in rows] == [(s.name, s.n_removed) for s in ref.stages[1:]]
    assert int(next(r["removed"] for r in rows if r["stage"] == "top_k")) == tr.lm.shape.vocab_size - 5
    data = json.load(open(paths[1], encoding="utf-8"))
    assert data["settings"]["top_k"] == 5 and data["model"] == "random-llama-tiny" and len(data["top_tokens"]) == 20
    kept = [t for t in data["top_tokens"] if t["prob_after_filters"] > 0]
    assert len(kept) <= 5 and all(t["removed_by"] is None for t in kept)
    # a bad setting: its sentence under the settings, nothing written
    files, msg = explore_tab.export_stages(state, 0.8, -3, 0.9, 0.0, 1.0, 0.0, 1.5)
    assert isinstance(files, type(explore_tab.gr.skip())) and msg["visible"] and "eta" in msg["value"]


def test_generate_samples_download_is_the_table_shown(tmp_path):
    """Generate's N samples, drawn by the tab's own callback on a tiny random-weight model."""
    import json

    import gradio as gr

    from app.shared.context import Shared
    from app.shared.exports import write_samples
    from app.tabs.generate import tab as generate_tab

    with gr.Blocks():
        shared = Shared(model=gr.Dropdown(["random-llama-tiny"], value="random-llama-tiny"), prompt=gr.Textbox(),
                        chat=gr.Checkbox())
        tab = generate_tab.build(shared)
    *_, last = tab.samples("random-llama-tiny", "Once upon", False, 6, 1.0, 0, 1.0, 0.0, 1.0, 7, "", 3)
    table = last[tab.samples_df]
    csv_path, json_path = write_samples(table, tmp_path, {"model": "random-llama-tiny"})
    rows = list(csv.DictReader(open(csv_path, encoding="utf-8")))
    assert [(int(r["seed"]), r["text"], int(r["tokens"]), r["finish"]) for r in rows] == [
        (s, t, n, f) for s, t, n, _, f in table[:-1]]
    assert [s for s, *_ in table[:-1]] == [7, 8, 9]
    data = json.load(open(json_path, encoding="utf-8"))
    assert data["summary"] == table[-1][1] and "distinct texts out of 3" in data["summary"]
    assert [s["mean_p"] for s in data["samples"]] == [row[3] for row in table[:-1]]
    # the same table as Gradio hands it to a callback (a pandas DataFrame)
    import pandas as pd

    (tmp_path / "df").mkdir()
    df = pd.DataFrame(table, columns=["seed", "text", "tokens", "mean p", "finish"])
    assert write_samples(df, tmp_path / "df")[0].read_text(encoding="utf-8") == csv_path.read_text(encoding="utf-8")


def _job(i, kind="sft", state="succeeded", **extra):
    import time

    now = time.time()
    rec = {"id": f"job{i}", "kind": kind, "state": state, "created": now - 100, "started": now - 90,
           "finished": now - 10 if state != "running" else None, "owner": "local",
           "progress": {"fraction": 1.0 if state == "succeeded" else 0.4, "stage": "training", "eta_seconds": 30},
           "params": {"model": "random-llama-tiny", "method": "lora" if i % 2 else "full", "lora_rank": 4,
                      "max_steps": 8, "batch_size": 2, "learning_rate": 1e-3},
           "log": ["started", "step 1"]}
    rec.update(extra)
    return rec


def test_runs_and_jobs_downloads_are_the_tables_shown(tmp_path):
    """The Fine-tune runs table and the Jobs table as CSV (what the tabs show, built by their own
    table functions) and JSON (the records' settings and results, logs left out)."""
    import json

    from app.shared import job_views as jf
    from app.shared.job_views import write_jobs
    from app.tabs.finetune import figures as sf
    from app.tabs.finetune.downloads import write_runs

    recs = [_job(1, sft={"model_name": "tiny-sft-lora-1", "metrics": {"steps": 8, "final_loss": 2.5, "final_eval_loss": 2.75,
                                                                      "tokens_per_s": 812.4},
                         "accuracy_before": {"correct": 1, "n": 4}, "accuracy_after": {"correct": 3, "n": 4},
                         "history": [{"step": 1, "loss": 3.0}, {"step": 8, "loss": 2.5}]}),
            _job(2, state="running", sft={"metrics": {}})]
    csv_path, json_path = write_runs(recs, tmp_path)
    rows = list(csv.DictReader(open(csv_path, encoding="utf-8")))
    shown = sf.runs_table(recs)
    assert [r["job"] for r in rows] == ["job1", "job2"]
    assert [[r[c] for c in sf.RUN_COLUMNS] for r in rows] == [["" if v is None else str(v) for v in row]
                                                              for row in shown.values.tolist()]
    data = json.load(open(json_path, encoding="utf-8"))["runs"]
    assert data[0]["metrics"]["final_loss"] == 2.5 and data[0]["accuracy_after"] == {"correct": 3, "n": 4}
    assert data[0]["history"][-1] == {"step": 8, "loss": 2.5} and data[1]["state"] == "running"

    jobs = recs + [_job(3, kind="tokenizer", state="failed", error="boom")]
    csv_path, json_path = write_jobs(jobs, tmp_path)
    rows = list(csv.DictReader(open(csv_path, encoding="utf-8")))
    shown = jf.jobs_table(jobs)
    assert list(rows[0]) == jf.JOB_COLUMNS
    assert [[r[c] for c in jf.JOB_COLUMNS] for r in rows] == [[str(v) for v in row] for row in shown.values.tolist()]
    data = json.load(open(json_path, encoding="utf-8"))["jobs"]
    assert [d["id"] for d in data] == ["job1", "job2", "job3"] and data[2]["error"] == "boom"
    assert all("log" not in d for d in data) and data[0]["params"]["method"] == "lora"
    # nothing to show: a header, an empty list
    csv_path, json_path = write_jobs([], tmp_path)
    assert csv_path.read_text().strip() == ",".join(jf.JOB_COLUMNS) and json.loads(json_path.read_text()) == {"jobs": []}
