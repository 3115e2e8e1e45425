"""SFT uploads with malformed lines (issue 20): the error names them; `skip_bad_lines` trains on the
good ones instead and the job record says what was skipped. Real files, a real Valkey and worker,
a real (tiny, random-weight) model trained on what was kept."""

from __future__ import annotations

import argparse
import json

import pytest

from model_core.core.errors import SettingsError
from model_core.training import sft

TINY = "random-llama-tiny"


def _ex(q: str, a: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})


def _six_lines_two_bad(path):
    lines = [
        _ex("2024-03-15?", "15/03/2024"),
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant" "content": "a"}]}',  # 2: no comma
        json.dumps({"prompt": "1999-12-31?", "completion": "31/12/1999"}),
        _ex("2001-01-02?", "02/01/2001"),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),  # 5: no assistant turn
        _ex("1970-07-04?", "04/07/1970"),
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_default_raises_naming_the_bad_lines(tmp_path):
    p = _six_lines_two_bad(tmp_path / "six.jsonl")
    with pytest.raises(sft.DatasetError) as e:
        sft.load_jsonl(p)
    msg = str(e.value)
    assert msg.startswith("2 malformed line(s) in 'six.jsonl'")
    assert "line 2: not valid JSON (Expecting ',' delimiter at column 70)" in msg
    assert "line 5: no assistant turn" in msg
    assert not any(f"line {i}:" in msg for i in (1, 3, 4, 6))
    assert "\n" not in msg and msg.endswith("(nothing to learn from).")


def test_skip_bad_returns_the_good_examples_and_a_report(tmp_path):
    p = _six_lines_two_bad(tmp_path / "six.jsonl")
    convs, rep = sft.load_jsonl(p, skip_bad=True)
    assert len(convs) == 4
    assert [c[-1]["content"] for c in convs] == ["15/03/2024", "31/12/1999", "02/01/2001", "04/07/1970"]
    assert rep["lines_kept"] == 4 and rep["lines_skipped"] == 2 and rep["file"] == "six.jsonl"
    assert [s["line"] for s in rep["skipped"]] == [2, 5]
    assert rep["skipped"][0]["reason"].startswith("not valid JSON (Expecting ',' delimiter at column 70)")
    assert rep["skipped"][1]["reason"].startswith("no assistant turn")
    assert rep["message"].startswith("Kept 4 of 6 lines of 'six.jsonl'; skipped 2 malformed: line 2: ")
    assert "line 5: no assistant turn" in rep["message"] and "\n" not in rep["message"]
    # the kept examples are exactly what the same good lines alone give
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(l for i, l in enumerate(p.read_text().splitlines(), 1) if i not in (2, 5)))
    assert sft.load_jsonl(good) == convs
    # a clean file: skip_bad reports nothing skipped
    clean, rep = sft.load_jsonl(good, skip_bad=True)
    assert clean == convs and rep["lines_skipped"] == 0 and rep["skipped"] == []


def test_skip_bad_names_only_the_first_few(tmp_path):
    p = tmp_path / "many.jsonl"
    p.write_text("\n".join([_ex("q", "a")] + ["{broken"] * 8) + "\n")
    convs, rep = sft.load_jsonl(p, skip_bad=True, max_errors=3)
    assert len(convs) == 1 and rep["lines_skipped"] == 8
    assert [s["line"] for s in rep["skipped"]] == [2, 3, 4] and "(and 5 more)" in rep["message"]


def test_all_bad_still_raises(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "x"}\n\n[1, 2]\nnot json\n')
    with pytest.raises(sft.DatasetError) as e:
        sft.load_jsonl(p, skip_bad=True)
    msg = str(e.value)
    assert msg.startswith("No usable examples in 'bad.jsonl': all 3 line(s) are malformed")
    assert "line 1:" in msg and "line 3:" in msg and "line 4: not valid JSON" in msg
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(sft.DatasetError, match="no examples"):
        sft.load_jsonl(empty, skip_bad=True)


def test_check_dataset_and_option_parsing(tmp_path):
    from tasks import sft_job

    p = _six_lines_two_bad(tmp_path / "six.jsonl")
    with pytest.raises(sft.DatasetError, match="line 2"):
        sft_job.check_dataset(p)
    convs, rep = sft_job.check_dataset(p, skip_bad_lines=True)
    assert len(convs) == 4 and rep["lines_skipped"] == 2
    with pytest.raises(SettingsError, match="skip_bad_lines"):
        sft_job.parse_skip_bad_lines("maybe")
    assert sft_job.parse_skip_bad_lines("true") is True and sft_job.parse_skip_bad_lines(None) is False
    # the CLI flag: lmscope jobs submit sft --dataset six.jsonl --skip-bad-lines
    ap = argparse.ArgumentParser()
    sft_job.add_sft_arguments(ap)
    params, files = sft_job.sft_params_from_args(ap.parse_args(["--dataset", str(p), "--skip-bad-lines"]))
    assert params["skip_bad_lines"] is True and files == [str(p)]
    params, _ = sft_job.sft_params_from_args(ap.parse_args(["--dataset", str(p)]))
    assert "skip_bad_lines" not in params


@pytest.mark.integration
def test_job_with_skip_bad_lines_records_and_trains_on_the_kept_lines(tmp_path):
    from tests.helpers.services import LiveServices

    svc = LiveServices(tmp_path / "jobs-data", stale_s=6.0).start()
    try:
        from tasks import jobs

        p = _six_lines_two_bad(tmp_path / "six.jsonl")
        run = {"model": TINY, "max_steps": 2, "batch_size": 2, "learning_rate": 1e-3, "accuracy_examples": 1}
        with pytest.raises(sft.DatasetError, match="line 2"):  # default: refused, nothing queued
            jobs.submit("sft", run, owner="t-skip", files=[p])
        assert jobs.list_jobs(owner="t-skip") == []
        with pytest.raises(SettingsError, match="skip_bad_lines"):
            jobs.submit("sft", {**run, "skip_bad_lines": "sometimes"}, owner="t-skip", files=[p])
        allbad = tmp_path / "allbad.jsonl"
        allbad.write_text("{oops\n")
        with pytest.raises(sft.DatasetError, match="No usable examples"):
            jobs.submit("sft", {**run, "skip_bad_lines": True}, owner="t-skip", files=[allbad])
        assert jobs.list_jobs(owner="t-skip") == []

        rec = jobs.submit("sft", {**run, "skip_bad_lines": True}, owner="t-skip", files=[p])
        assert rec["params"]["skip_bad_lines"] is True and rec["params"]["dataset"] == "upload"
        lines = rec["sft"]["dataset_lines"]
        assert lines["kept"] == 4 and lines["skipped"] == 2 and lines["file"] == "six.jsonl"
        assert [s["line"] for s in lines["skipped_lines"]] == [2, 5]
        assert any("Kept 4 of 6 lines" in line for line in rec["log"])
        stored = jobs.get_job(rec["id"])  # what any other process reads back from Valkey
        assert stored["sft"]["dataset_lines"] == lines and stored["params"]["skip_bad_lines"] is True

        done = jobs.wait_job(rec["id"], timeout=180, poll=0.2)
        assert done["state"] == "succeeded", (done, svc.worker_log())
        data = done["sft"]["data"]
        assert data["train"]["total"] + (data["eval"] or {}).get("total", 0) == 4  # the kept lines, no more
        assert done["sft"]["dataset_lines"] == lines  # progress writes kept it
    finally:
        svc.stop()
