"""tasks.diff_job.precompute, the short diff a training job runs on its registered model as its last
stage: it writes diff.json, and whatever goes wrong in it (a cancel pressed then included) is a log
line, never an exception that would end the training job as cancelled or failed. The job here is a
stand-in for tasks.lifecycle.Job's file and progress calls (stage, say, ticker, write_json): what is
tested is precompute, not the worker; the worker path runs in tests/integration/test_model_diff.py."""

from __future__ import annotations

import json

from tasks import diff_job
from tasks.lifecycle import Cancelled

TINY = "random-llama-tiny"


class _Job:
    def __init__(self, folder, fail_with: BaseException | None = None):
        self.dir, self.fail_with, self.lines, self.stages = folder, fail_with, [], []

    def stage(self, name, fraction, log=None, est=None):
        self.stages.append((name, fraction))

    def say(self, line):
        self.lines.append(line)

    def ticker(self, stage, lo, hi, every_s):
        return lambda f: None

    def write_json(self, name, obj):
        if self.fail_with is not None:
            raise self.fail_with
        path = self.dir / name
        path.write_text(json.dumps(obj), encoding="utf-8")
        return path


def test_precompute_writes_the_diff(tmp_path):
    job = _Job(tmp_path)
    path = diff_job.precompute(job, TINY, TINY)
    report = json.loads(path.read_text())
    assert report["meta"]["precomputed"] and report["tokens"] == diff_job.PRECOMPUTE_TOKENS
    assert report["mean_kl"] == 0.0 and report["across_run"] is None  # itself; a registry model kept no run
    assert job.stages[0][0] == "what changed" and "mean KL" in job.lines[-1]


def test_anything_that_goes_wrong_is_a_log_line(tmp_path):
    for failure in (Cancelled("cancel pressed during the pass"), MemoryError(), KeyError("step")):
        job = _Job(tmp_path, fail_with=failure)
        assert diff_job.precompute(job, TINY, TINY) is None
        assert job.lines[-1].startswith("what changed: not precomputed"), job.lines
    job = _Job(tmp_path)
    assert diff_job.precompute(job, "no-such-model", TINY) is None
    assert "no-such-model" in job.lines[-1]
