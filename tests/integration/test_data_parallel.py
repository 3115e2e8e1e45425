"""Training in several processes, data parallel (model_core.training.data_parallel), on the CPU with gloo:
the same launcher, Trainer and accelerate path that a GPU machine takes with NCCL, one process per
GPU. The reference is the same run in one process with the whole batch (the issue's bar: N GPUs
give the loss curve of one GPU with N times the per-GPU batch); fp32 on the CPU, so the curves agree
to all-reduce rounding. Also: a cancel stops every process after the same step and registers
nothing; an error raised in the processes reaches the caller as itself."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from model_core.training import preference as P
from model_core.training import preference_data as D
from model_core.training import sft

TINY = "random-llama-tiny"
RUN = {"model": TINY, "dataset": "builtin", "batch_size": 8, "learning_rate": 3e-3, "accuracy_examples": 0,
       "eval_fraction": 0.0, "max_steps": 4, "sample_every": 0, "seed": 0}


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def _name(tag: str) -> str:
    return f"dp-{tag}-{uuid.uuid4().hex[:6]}"


def _losses(rows) -> list[float]:
    return [r["loss"] for r in rows if r.get("loss") is not None]


def test_two_processes_train_as_one_process_with_the_whole_batch(data_dir):
    one_rows, two_rows, logs = [], [], []
    one = sft.run_sft_on_gpus({**RUN, "output_name": _name("one")}, progress=one_rows.append, processes=1)
    two = sft.run_sft_on_gpus({**RUN, "output_name": _name("two")}, progress=two_rows.append, log=logs.append,
                              processes=2)
    assert any("2 processes, 4 examples each" in m for m in logs)
    assert len(_losses(two_rows)) == len(_losses(one_rows)) == 4
    assert _losses(two_rows) == pytest.approx(_losses(one_rows), rel=1e-5)
    assert _losses(two_rows)[-1] < _losses(two_rows)[0]  # it trained
    assert two.info["metrics"]["tokens_seen"] == one.info["metrics"]["tokens_seen"]  # every example, once
    w1, w2 = load_file(str(one.path / "model.safetensors")), load_file(str(two.path / "model.safetensors"))
    assert w1.keys() == w2.keys()
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5
    base = sft.load_trainable(TINY, "cpu")[0].state_dict()
    assert max(float((w2[k] - base[k]).abs().max()) for k in w2 if k in base) > 1e-3  # and moved
    registered = sorted(p.name for p in (data_dir / "models").iterdir())
    assert registered == sorted([one.name, two.name])  # the main process alone registered


def _job_in_a_pool_process(settings: dict, out) -> None:
    """A job as a pool process of the Celery worker runs it: in a daemonic process."""
    rows, logs = [], []
    try:
        sft.run_sft_on_gpus(settings, progress=rows.append, log=logs.append)
        out.put((_losses(rows), logs, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails with it
        out.put(([], logs, repr(e)))


def test_loader_processes_asked_for_in_a_daemonic_process_train_the_same_steps(data_dir):
    """A job that wants loader processes (GPUs want 2) from a daemonic process, where the DataLoader may
    not start them, trains in a process of its own, where they start; its losses equal the same run in
    this process with the batches built in the training loop."""
    inline = []
    sft.run_sft_on_gpus({**RUN, "loader_workers": 0, "output_name": _name("inline")}, progress=inline.append)
    ctx = multiprocessing.get_context("spawn")  # a forked copy of this process can hang in torch's thread pools
    out = ctx.Queue()
    pool_process = ctx.Process(target=_job_in_a_pool_process, daemon=True,
                               args=({**RUN, "loader_workers": 2, "output_name": _name("loader")}, out))
    pool_process.start()
    losses, logs, error = out.get(timeout=300)
    pool_process.join(60)
    assert error is None, (error, logs)
    assert any("process of its own" in m for m in logs), logs
    assert any("2 loader processes build the batches" in m for m in logs), logs
    assert len(losses) == 4
    assert losses == pytest.approx(_losses(inline), rel=1e-5)


def test_a_cancel_stops_every_process_and_registers_nothing(data_dir):
    rows = []
    name = _name("cancel")
    with pytest.raises(sft.SFTCancelled):
        sft.run_sft_on_gpus({**RUN, "max_steps": 50, "output_name": name}, progress=rows.append,
                            should_stop=lambda: len(_losses(rows)) >= 2, processes=2)
    assert 2 <= len(_losses(rows)) < 50
    assert not (data_dir / "models" / name).exists()


def test_an_error_in_the_processes_reaches_the_caller_as_itself(data_dir):
    name = _name("taken")
    sft.run_sft_on_gpus({**RUN, "max_steps": 1, "output_name": name}, processes=1)
    with pytest.raises(sft.SFTError, match="already exists"):
        sft.run_sft_on_gpus({**RUN, "max_steps": 1, "output_name": name}, processes=2)
    with pytest.raises(sft.SFTError, match="does not split over 2"):
        sft.run_sft_on_gpus({**RUN, "batch_size": 5, "output_name": _name("odd")}, processes=2)


def test_dpo_in_two_processes_follows_the_one_process_curve(data_dir):
    """TRL's DPOTrainer under the same launcher: the per-step DPO loss of 2 processes x 2 pairs equals
    1 process x 4 pairs (DDP averages the two halves' gradients; the logged loss is their mean)."""
    settings = {"max_steps": 3, "batch_size": 4, "eval_examples": 0, "learning_rate": 1e-3, "seed": 1}
    runs = {}
    for n in (1, 2):
        rows = []
        res = P.train_on_gpus("dpo", TINY, "builtin", {**settings, "output_name": _name(f"dpo{n}")},
                              progress=lambda step, total, m, rows=rows: rows.append(m), processes=n)
        runs[n] = ([r["loss"] for r in rows if r.get("loss") is not None], res)
    assert len(runs[1][0]) == 3
    assert runs[2][0] == pytest.approx(runs[1][0], rel=1e-4)
    assert runs[2][1].info["kind"] == "dpo" and runs[2][1].path.exists()
    data = D.builtin_preferences(8, 2, seed=0)  # in memory: cannot travel to the processes; one sentence
    with pytest.raises(P.PreferenceError, match="by name or file path"):
        P.train_on_gpus("dpo", TINY, data, {**settings, "output_name": _name("mem")}, processes=2)


def _processes_running(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                continue
    return pids


def test_a_killed_caller_takes_its_training_processes_down(data_dir, tmp_path):
    """The worker process dies mid-run (SIGKILL: no Python cleanup runs): the launcher it started gets
    SIGTERM from the kernel (PR_SET_PDEATHSIG) and stops the training processes, so they neither keep
    training nor register a model for a job that ended."""
    name = _name("orphan")
    started = tmp_path / "started"
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
              "from pathlib import Path\nfrom model_core.training import sft\n"
              f"sft.run_sft_on_gpus({{**{RUN!r}, 'max_steps': 100000, 'output_name': {name!r}}}, processes=2,\n"
              f"    progress=lambda r: Path({str(started)!r}).touch())\n")
    parent = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "LMSCOPE_DATA_DIR": str(data_dir)})
    deadline = time.time() + 240
    while not started.exists() and time.time() < deadline and parent.poll() is None:
        time.sleep(0.5)
    assert started.exists(), "training never started"
    assert _processes_running("model_core.training.data_parallel")
    parent.kill()
    parent.wait()
    deadline = time.time() + 60
    while _processes_running("model_core.training.data_parallel") and time.time() < deadline:
        time.sleep(0.5)
    assert not _processes_running("model_core.training.data_parallel")
    assert not (data_dir / "models" / name).exists()
