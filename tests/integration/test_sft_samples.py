"""Sample generations during SFT and intermediate checkpoints (issue 20): held-out prompts generated
greedily at step 0, during and after training, equal to transformers' own greedy generation of the
model as it stood at that step; checkpoints registered as '<name>-step<S>' that are the model at that
step (LoRA merged in a copy), leave training undisturbed, and vanish with a cancelled run; the
record's samples through a real worker; the table that draws them."""

from __future__ import annotations

import argparse
import json
import time
import uuid

import pytest
import torch
from safetensors.torch import load_file

from model_core.training import sft

TINY = "random-llama-tiny"
RUN = {"model": TINY, "dataset": "builtin", "batch_size": 4, "learning_rate": 3e-3, "accuracy_examples": 4,
       "eval_fraction": 0.1, "eval_every": 4}


@pytest.fixture(autouse=True)
def one_thread():
    """A 64-wide model gains nothing from a second thread, and loses a lot on a busy 2-core machine
    (every tiny op waits for the other OpenMP thread)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


def _name(tag: str) -> str:
    return f"tiny-{tag}-{uuid.uuid4().hex[:6]}"  # the registry's load cache is keyed by name


def _reference_greedy(model, tokenizer, question: str, max_new_tokens: int) -> str:
    """transformers' generate(do_sample=False) on the rendering of lmscope's simple chat template,
    written out by hand: 'user: <q><eos>\\nassistant: '."""
    text = f"user: {question}{tokenizer.eos_token}\nassistant: "
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def _weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _logits(lm, ids) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0]


# ---- settings ----------------------------------------------------------------------------------

def test_settings_schedules_and_cli():
    s = sft.validate_settings({})
    assert (s.sample_every, s.sample_prompts, s.keep_checkpoints) == (None, 3, 0)
    for bad, match in [({"sample_every": -1}, "'sample_every' must be between 0"),
                       ({"sample_every": 2.5}, "'sample_every' must be a number"),
                       ({"sample_prompts": "three"}, "'sample_prompts' must be a number"),
                       ({"sample_prompts": 21}, "'sample_prompts' must be between 0 and 20"),
                       ({"keep_checkpoints": 99}, "'keep_checkpoints' must be between 0 and 20, got 99"),
                       ({"keep_checkpoints": True}, "'keep_checkpoints' must be a number"),
                       ({"keep_checkpoints": 2, "output_name": "x" * 95}, "too long")]:
        with pytest.raises(sft.SettingsError, match=match) as e:
            sft.validate_settings(bad)
        assert str(e.value).count(". ") == 0  # one sentence
    assert sft.validate_settings({"keep_checkpoints": 2, "output_name": "x" * 80}).keep_checkpoints == 2
    # step 0, about 4 points, the last step always; 0 (or no prompts) = off
    assert sft.sample_steps(8, None, 3) == [0, 2, 4, 6, 8]
    assert sft.sample_steps(10, None, 3) == [0, 3, 6, 9, 10]
    assert sft.sample_steps(4, 2, 3) == [0, 2, 4] and sft.sample_steps(1, None, 3) == [0, 1]
    assert sft.sample_steps(8, 0, 3) == [] and sft.sample_steps(8, 2, 0) == []
    assert sft.checkpoint_steps(4, 1) == [2] and sft.checkpoint_steps(10, 3) == [2, 5, 8]
    assert sft.checkpoint_steps(3, 5) == [1, 2] and sft.checkpoint_steps(1, 2) == [] and sft.checkpoint_steps(8, 0) == []
    # the job params and the CLI
    from tasks import sft_job

    v = sft_job.validate_params({"model": TINY, "sample_every": 5, "keep_checkpoints": 2})
    assert (v["sample_every"], v["sample_prompts"], v["keep_checkpoints"]) == (5, 3, 2)
    with pytest.raises(sft.SettingsError, match="keep_checkpoints"):
        sft_job.validate_params({"model": TINY, "keep_checkpoints": -1})
    ap = argparse.ArgumentParser()
    sft_job.add_sft_arguments(ap)
    params, _ = sft_job.sft_params_from_args(ap.parse_args(["--model", TINY, "--sample-every", "0",
                                                            "--keep-checkpoints", "3", "--sample-prompts", "2"]))
    assert (params["sample_every"], params["keep_checkpoints"], params["sample_prompts"]) == (0, 3, 2)
    assert "keep_checkpoints" not in sft_job.sft_params_from_args(ap.parse_args(["--model", TINY]))[0]


# ---- one run: samples at 0, 2, 4 and a checkpoint at step 2 --------------------------------------

def test_samples_and_a_checkpoint_are_the_model_at_their_step(data_dir):
    from model_core import list_models, load_model

    name = _name("samples")
    rows = []
    res = sft.run_sft({**RUN, "max_steps": 4, "sample_every": 2, "keep_checkpoints": 1, "output_name": name},
                      progress=rows.append)
    # samples: steps 0, 2, 4 for each of the 3 held-out prompts, emitted as the run goes
    got = [(r["step"], r["index"]) for r in res.samples]
    assert got == [(st, i) for st in (0, 2, 4) for i in range(3)]
    assert all(isinstance(r["completion"], str) for r in res.samples)
    order = [("samples", r["step"]) if r.get("phase") == "samples" else ("loss", r["step"])
             for r in rows if r.get("phase") == "samples" or r.get("loss") is not None]
    assert order == [("samples", 0), ("loss", 1), ("samples", 2), ("loss", 2), ("loss", 3), ("samples", 4),
                     ("loss", 4)]
    assert [x for r in rows if r.get("phase") == "samples" for x in r["samples"]] == res.samples
    # held-out prompts with their answers, never trained on
    train, held = sft.builtin_dataset(64, 4, 0)
    assert [(r["prompt"], r["expected"]) for r in res.samples[:3]] == [(p[0]["content"], a) for p, a in held[:3]]
    assert not {r["prompt"] for r in res.samples} & {c[0]["content"] for c in train}
    assert all(r["correct"] == (r["completion"].strip() == r["expected"]) for r in res.samples)

    # each sample is transformers' greedy generation by the model as it stood at that step
    n_new = res.info["sampling"]["max_new_tokens"]
    assert n_new == 24 and res.info["sampling"]["steps"] == [0, 2, 4]
    ckpt = f"{name}-step2"
    models = {0: load_model(TINY), 2: load_model(ckpt), 4: load_model(name)}
    for r in res.samples:
        lm = models[r["step"]]
        assert r["completion"] == _reference_greedy(lm.model, load_model(TINY).tokenizer, r["prompt"], n_new), r
    assert {r["completion"] for r in res.samples if r["step"] == 0} != {r["completion"] for r in res.samples
                                                                         if r["step"] == 4}

    # the checkpoint: registered like any fine-tuned model, and a real intermediate state
    assert [(c["name"], c["step"]) for c in res.checkpoints] == [(ckpt, 2)]
    cdir, fdir = data_dir / "models" / ckpt, data_dir / "models" / name
    assert res.checkpoints[0]["path"] == cdir
    assert {p.name for p in cdir.iterdir()} == {p.name for p in fdir.iterdir()}
    meta = json.loads((cdir / "lmscope.json").read_text())
    assert (meta["parent"], meta["checkpoint_of"], meta["step"], meta["max_steps"]) == (TINY, name, 2, 4)
    assert meta["metrics"]["steps"] == 2 and max(h["step"] for h in meta["history"]) == 2
    assert meta["accuracy_after"] is None and [r["step"] for r in meta["samples"]] == [2, 2, 2]
    final_meta = json.loads((fdir / "lmscope.json").read_text())
    assert final_meta["checkpoints"] == [{"name": ckpt, "step": 2}] and final_meta["samples"] == res.samples
    assert "checkpoint_of" not in final_meta and final_meta["metrics"]["steps"] == 4
    listed = {r["name"]: r for r in list_models() if r["source"] == "finetuned"}
    assert listed[ckpt]["parent"] == TINY and set(listed) == {name, ckpt}
    assert models[2].source == "finetuned" and models[2].meta["checkpoint_of"] == name
    ids = list(range(40, 80))
    lp, lc, lf = (_logits(models[s], ids) for s in (0, 2, 4))
    assert (lc - lp).abs().max() > 1e-3 and (lc - lf).abs().max() > 1e-3
    assert not (data_dir / "sft-staging").exists() or not any((data_dir / "sft-staging").iterdir())

    # sampling and checkpointing leave training alone: the same run without them saves the same model
    plain = sft.run_sft({**RUN, "max_steps": 4, "sample_every": 0, "output_name": _name("plain")})
    assert plain.samples == [] and plain.checkpoints == [] and plain.info["sampling"]["steps"] == []
    a, b = _weights(fdir), _weights(plain.path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(_logits(load_model(plain.name), ids), lf)
    # a checkpoint name that is taken stops a run before it trains
    taken = _name("taken")
    (data_dir / "models" / f"{taken}-step2").mkdir()
    with pytest.raises(sft.SFTError, match=f"'{taken}-step2' already exists .*checkpoint at step 2"):
        sft.run_sft({**RUN, "max_steps": 4, "keep_checkpoints": 1, "accuracy_examples": 0, "output_name": taken})
    assert not (data_dir / "models" / taken).exists()


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_checkpoint_equals_the_final_model_of_a_run_that_stopped_there(data_dir, method):
    """Step 1 of a 2-step run is the whole of a 1-step run (the linear schedule's first learning rate
    does not depend on the run's length): the checkpoint (for LoRA, merged in a copy while the
    adapter kept training) must be bit-equal to that run's final model, which LoRA merges with peft's
    merge_and_unload."""
    run = {**RUN, "method": method, "lora_rank": 4, "learning_rate": 1e-2 if method == "lora" else 3e-3,
           "accuracy_examples": 0, "sample_every": 0}
    two = sft.run_sft({**run, "max_steps": 2, "keep_checkpoints": 1, "output_name": _name(f"{method}2")})
    one = sft.run_sft({**run, "max_steps": 1, "output_name": _name(f"{method}1")})
    ck = two.checkpoints[0]
    assert ck["step"] == 1 and ck["name"] == f"{two.name}-step1"
    c, o, f = _weights(ck["path"]), _weights(one.path), _weights(two.path)
    assert c.keys() == o.keys() == f.keys() and not any("lora" in k for k in c)
    assert all(torch.equal(c[k], o[k]) for k in c)
    assert not all(torch.equal(c[k], f[k]) for k in c)
    assert json.loads((ck["path"] / "config.json").read_text()) == json.loads((one.path / "config.json").read_text())


def test_a_cancelled_run_leaves_no_checkpoint(data_dir):
    name = _name("cancel")
    staging = data_dir / "sft-staging"
    losses, seen_staging, logs = [], set(), []

    def stop():
        if staging.exists():
            seen_staging.update(d.name.split(".")[0] for d in staging.iterdir())
        return len(losses) >= 5

    with pytest.raises(sft.SFTCancelled):
        sft.run_sft({**RUN, "max_steps": 8, "keep_checkpoints": 3, "sample_every": 4, "accuracy_examples": 0,
                     "output_name": name},
                    progress=lambda r: losses.append(r) if r.get("loss") is not None else None,
                    should_stop=stop, log=logs.append)
    # checkpoints at steps 2 and 4 had been written when the cancel came after step 5
    assert {f"{name}-step2", f"{name}-step4"} <= seen_staging and f"{name}-step6" not in seen_staging
    assert sum("checkpoint at step" in m for m in logs) == 2
    assert not any((data_dir / "models").iterdir()) and not any(staging.iterdir())


# ---- the record, through a real worker ------------------------------------------------------------

@pytest.mark.integration
def test_job_record_gets_samples_while_it_runs(tmp_path, monkeypatch):
    from tests.helpers.services import LiveServices

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker's torch: see one_thread
    svc = LiveServices(tmp_path / "jobs-data", stale_s=6.0).start()
    try:
        from model_core import load_model
        from tasks import jobs

        name = _name("job")
        rec = jobs.submit("sft", {**RUN, "max_steps": 40, "sample_every": 10, "keep_checkpoints": 1,
                                  "accuracy_examples": 0, "eval_every": 40, "output_name": name}, owner="t")
        assert rec["params"]["sample_every"] == 10 and rec["params"]["keep_checkpoints"] == 1
        live, t0 = [], time.time()
        while time.time() - t0 < 120:
            r = jobs.get_job(rec["id"])
            if r["state"] == "running" and (r.get("sft") or {}).get("samples"):
                live.append(sorted({x["step"] for x in r["sft"]["samples"]}))
            if r["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.05)
        done = jobs.wait_job(rec["id"], timeout=60, poll=0.2)
        assert done["state"] == "succeeded", (done, svc.worker_log())
        assert live and live[0][0] == 0 and live[0] != [0, 10, 20, 30, 40], live  # seen growing, from step 0
        s = done["sft"]
        assert [(x["step"], x["index"]) for x in s["samples"]] == [(st, i) for st in (0, 10, 20, 30, 40)
                                                                    for i in range(3)]
        assert all(isinstance(x["completion"], str) and x["expected"] for x in s["samples"])
        assert s["checkpoints"] == [{"name": f"{name}-step20", "step": 20}]
        assert f"{name}-step20" in done["log"][-1], done["log"][-1]
        lm = load_model(f"{name}-step20")
        assert lm.meta["checkpoint_of"] == name and lm.meta["parent"] == TINY
    finally:
        svc.stop()


# ---- the table ----------------------------------------------------------------------------------------

def test_samples_table_html():
    from app.tabs.finetune.figures import samples_table_html

    empty = samples_table_html([])
    assert "No sample generations yet" in empty and "<table" not in empty and samples_table_html(None) == empty
    rows = [{"step": st, "index": i, "prompt": f"q{i} <b>", "completion": c, "expected": "01/02/2003",
             "correct": c == "01/02/2003"}
            for st, cs in ((0, ["nope", "no"]), (5, ["01/02/2003", "x"]), (10, ["01/02/2003", "01/02/2003"]))
            for i, c in enumerate(cs)]
    h = samples_table_html(rows)
    assert h.count("<tr>") == 1 + 2 + 1  # header, one row per prompt, the tally
    assert "<th>step 0 (before)</th><th>step 5</th><th>step 10</th>" in h
    assert "q0 &lt;b&gt;" in h and "<b>" not in h.replace("<b>0/2</b>", "").replace("<b>1/2</b>", "").replace(
        "<b>2/2</b>", "").replace("<b>correct</b>", "")
    assert h.count("data-correct='1'") == 3 and h.count("data-correct='0'") == 3
    assert h.count("#dcfce7") == 3 and h.count("#fee2e2") == 3
    assert "<b>0/2</b>" in h and "<b>1/2</b>" in h and "<b>2/2</b>" in h
    # unknown answers: no colours, no expected column, no tally
    free = samples_table_html([{"step": 0, "index": 0, "prompt": "hi", "completion": "", "expected": None,
                                "correct": None}])
    assert "expected" not in free and "#dcfce7" not in free and "#fee2e2" not in free and "(blank)" in free
    # the record keeps at most MAX_SAMPLE_STEPS steps, first and last among them
    many = [{"step": st, "index": 0} for st in range(0, 1001, 5)]
    kept = sft.thin_samples(many)
    steps = [r["step"] for r in kept]
    assert len(steps) == sft.MAX_SAMPLE_STEPS and steps[0] == 0 and steps[-1] == 1000
