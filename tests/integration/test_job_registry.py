"""The registry of job kinds (tasks.kinds) is the one door: the CLI's `jobs submit <kind>` choices,
the job service's kinds and the tasks a real worker registers all come from it, every kind has its
validate / submit / task, and a bad setting for each real kind is refused with one sentence before
anything is queued (real Valkey + a real Celery worker process)."""

from __future__ import annotations

import argparse

import pytest

from model_core.core.errors import LmscopeError

pytestmark = pytest.mark.integration

# One invalid setting per real kind, and words its sentence must hold. A kind added to the registry
# without a case here fails test_every_kind_refuses_a_bad_setting_before_queueing.
INVALID = {
    "tokenizer": ({"algorithm": "bpe", "vocab_size": 50}, "too small"),
    "patching": ({"model": "random-llama-tiny", "clean": "Eiffel is in Paris", "corrupted": "Colosse is in Rome",
                  "target": "P", "sweep": "neurons"}, "Unknown sweep"),
    "sft": ({"model": "random-llama-tiny", "max_steps": 2, "learning_rate": -1}, "'learning_rate' must be between"),
    "pretrain": ({"width": 17, "max_steps": 2}, "multiple of 16"),
    "scaling": ({"widths": "sixty-four", "tokens": 4096}, "Widths must be whole numbers"),
    "neurons": ({"model": "random-llama-tiny", "tokens": 10}, "'tokens' must be between 64"),
    "reward": ({"model": "random-llama-tiny", "max_steps": 0}, "'max_steps' must be between 1"),
    "dpo": ({"model": "random-llama-tiny", "beta": 0}, "'beta' must be between"),
    "grpo": ({"model": "random-llama-tiny", "loss_type": "ppo"}, "GRPO loss type must be one of"),
    "ppo": ({"model": "random-llama-tiny", "reward_model": "no-such-reward-model"}, "No reward model named"),
    "heads": ({"model": "random-llama-tiny", "prompts": 0}, "'prompts' must be between 1"),
    "features": ({"model": "random-llama-tiny", "layer": 1, "k": 0}, "'k' must be a whole number from 1"),
    "diff": ({"tuned": "random-llama-tiny", "base": "random-llama-tiny", "max_tokens": 10}, "'max_tokens' must be between 256"),
    "crosscoder": ({"tuned": "random-llama-tiny", "base": "random-llama-tiny", "layer": 0, "l1_coeff": -1},
                   "'l1_coeff' must be between"),
    "transcoders": ({"model": "random-llama-tiny", "layers": "0,0"}, "'layers' names a layer twice"),
}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    from tests.helpers.services import LiveServices

    s = LiveServices(tmp_path_factory.mktemp("job-registry"), stale_s=6.0).start()
    yield s
    s.stop()


def _cli_kinds() -> list[str]:
    """The choices of `lmscope jobs submit <kind>`, from the parser the CLI builds."""
    from tasks.cli import add_jobs_parser

    p = argparse.ArgumentParser()
    add_jobs_parser(p.add_subparsers(dest="command"), lambda args: 0)
    jobs_parser = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices["jobs"]
    submit = next(a for a in jobs_parser._actions if isinstance(a, argparse._SubParsersAction)).choices["submit"]
    return list(next(a for a in submit._actions if a.dest == "kind").choices)


def test_cli_service_and_worker_kinds_come_from_the_registry(svc):
    from tasks import celery_app, jobs, kinds
    from tasks.lifecycle import JobTask

    names = kinds.names()
    assert set(names) == {"tokenizer", "patching", "sft", "pretrain", "scaling", "neurons", "reward", "dpo", "grpo",
                          "ppo", "heads", "features", "diff", "crosscoder", "transcoders"}
    assert _cli_kinds() == list(names)
    assert tuple(jobs.KINDS) == names
    for k in kinds.all_kinds():
        assert callable(k.validate) and callable(k.submit_job) and callable(k.params_from_args), k.name
        assert isinstance(k.task, JobTask) and k.task.name.startswith("lmscope."), k.name
        assert k.task.acks_late and k.task.reject_on_worker_lost, k.name
    # the worker process's own list of tasks (asked over the broker), against the registry's
    assert celery_app.app.conf.include == list(celery_app.KIND_MODULES)
    replies = celery_app.client().control.inspect(timeout=10).registered() or {}
    assert len(replies) == 1, replies  # this test's one worker
    [registered] = replies.values()
    ours = {n for n in registered if not n.startswith("celery.")}
    assert ours == {k.task.name for k in kinds.all_kinds()}, (ours, svc.worker_log())
    with pytest.raises(LmscopeError) as e:
        jobs.submit("a2c", {})
    assert "Unknown job kind 'a2c'" in str(e.value) and "tokenizer" in str(e.value)


def test_every_kind_refuses_a_bad_setting_before_queueing(svc):
    from tasks import config, jobs, kinds, store

    assert set(INVALID) == set(kinds.names()), "a registered kind has no bad-setting case here"
    r = store.client()
    ids_before = set(store.list_ids(None, 10_000, r))
    dirs_before = set(config.jobs_dir().iterdir())
    for name, (params, words) in INVALID.items():
        k = kinds.find(name)
        with pytest.raises(LmscopeError) as e:
            k.validate(dict(params))
        assert words in str(e.value), (name, str(e.value))
        with pytest.raises(LmscopeError) as e:
            jobs.submit(name, dict(params), owner="t-registry")
        msg = str(e.value)
        assert words in msg and "\n" not in msg and msg.endswith("."), (name, msg)
    assert set(store.list_ids(None, 10_000, r)) == ids_before  # no record
    assert set(config.jobs_dir().iterdir()) == dirs_before  # no job folder


def test_a_head_search_runs_on_the_worker_through_the_cli(svc):
    """A kind end to end through the registry's door: `lmscope jobs submit heads --wait --json` on
    the real worker; its heads.json equals model_core.interp.head_search run here on the same prompts (the
    held-out split of the built-in corpus), and the induction test's strongest head is in its log."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    from model_core import load_model
    from model_core.interp import head_search as HS
    from tasks.corpus import builtin_docs
    from tasks.lifecycle import artifact_path

    out = subprocess.run([sys.executable, "-m", "app.server.cli", "jobs", "submit", "heads", "--model", "random-llama-tiny",
                          "--prompts", "3", "--prompt-tokens", "24", "--wait", "--json"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, **svc.env()})
    assert out.returncode == 0, out.stderr[-2000:] + svc.worker_log()
    rec = json.loads(out.stdout)
    assert rec["state"] == "succeeded" and "strongest induction head L" in rec["log"][-1], rec
    got = json.loads(artifact_path(rec, "heads.json").read_text())
    want = HS.search_heads(load_model("random-llama-tiny"), builtin_docs("heldout"), 3, 24)
    assert got["prompts"] == want["prompts"]
    for m in HS.METRICS:
        assert got["metrics"][m]["top"] == want["metrics"][m]["top"], m
        np.testing.assert_allclose(np.array(got["metrics"][m]["mean"], float), np.array(want["metrics"][m]["mean"], float),
                                   atol=1e-5, err_msg=m)  # None (no repeated token) -> NaN on both sides
    np.testing.assert_allclose(got["induction_repeated"], want["induction_repeated"], atol=1e-5)
