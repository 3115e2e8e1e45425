"""Taking a fine-tuned model away: the zip is a Hugging Face folder that transformers loads to the
same logits as lmscope's registered model; its README.md is a model card from the run record; the
live route serves registered fine-tuned models only. And the TensorBoard event files an SFT run
writes (directly and as a job's tensorboard.zip artifact)."""

from __future__ import annotations

import io
import json
import re
import struct
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

from model_core.training import sft
from model_core.training.export import model_card, write_model_zip

TINY = "random-llama-tiny"
RUN = {"model": TINY, "dataset": "builtin", "batch_size": 8, "learning_rate": 3e-3, "max_steps": 2,
       "accuracy_examples": 4, "eval_fraction": 0.1, "seed": 3}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """One 2-step full fine-tune of random-llama-tiny, registered in this module's own data folder,
    with its TensorBoard event files in a folder beside it."""
    base = tmp_path_factory.mktemp("export")
    name = f"tiny-export-{uuid.uuid4().hex[:6]}"  # the registry's load cache is keyed by name
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMSCOPE_DATA_DIR", str(base / "data"))
        rows = []
        res = sft.run_sft({**RUN, "output_name": name}, progress=rows.append, tensorboard_dir=base / "tb" / name)
        yield {"base": base, "data": base / "data", "name": name, "res": res, "rows": rows}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _input_ids(tok):
    msgs = [{"role": "user", "content": "Rewrite the date 2001-02-03 in the format DD/MM/YYYY."}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def _check_loads_like_registered(folder: Path, name: str):
    """transformers' own loaders on the unzipped folder give the registered model's logits exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_core import load_model

    lm = load_model(name)
    assert lm.source == "finetuned"
    hf = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = _input_ids(tok)
    assert ids.shape[1] > 20 and ids.tolist() == _input_ids(lm.tokenizer).tolist()
    a, b = _logits(hf, ids), _logits(lm.model, ids.to(lm.device)).cpu()
    assert a.shape == (1, ids.shape[1], 258)
    assert torch.equal(a, b), (a - b).abs().max()
    # and it is not the parent: the zip carries the fine-tuned weights
    assert not torch.equal(a, _logits(load_model(TINY).model, ids))


# ---- the zip and its card --------------------------------------------------------------------------

def test_zip_loads_with_transformers_to_the_registered_logits(tuned, tmp_path):
    name, path = tuned["name"], tuned["res"].path
    meta = json.loads((path / "lmscope.json").read_text())
    out = tmp_path / "m.zip"
    written = write_model_zip(path, out, model_card(meta, name))
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        assert names == set(written)
        assert names == {f"{name}/{f}" for f in ("config.json", "generation_config.json", "model.safetensors",
                                                 "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                                 "README.md")}
        assert z.getinfo(f"{name}/model.safetensors").compress_type == zipfile.ZIP_STORED
        assert z.testzip() is None
        z.extractall(tmp_path / "unzipped")
    folder = tmp_path / "unzipped" / name
    assert (folder / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    _check_loads_like_registered(folder, name)

    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert f"# {name}" in card and f"fine-tune of **{TINY}**" in card and "Trained with lmscope." in card
    for row in ("| method | full fine-tuning |", "| learning rate | 0.003 |", "| steps | 2 |", "| batch size | 8 |",
                "| seed | 3 |", "| max length | 256 |"):
        assert row in card, row
    m, b, a = meta["metrics"], meta["accuracy_before"], meta["accuracy_after"]
    assert f"| final train loss | {m['final_loss']:.4f} |" in card
    assert f"| final eval loss | {m['final_eval_loss']:.4f} |" in card
    assert f"before → after | {b['correct']}/4 ({b['accuracy']:.0%}) → {a['correct']}/4 ({a['accuracy']:.0%}) |" in card
    assert "built-in task `date-reformat`" in card and "AutoModelForCausalLM.from_pretrained" in card
    assert str(tuned["data"]) not in card and "lmscope.json" not in names


def test_the_cards_own_code_runs_on_the_unzipped_folder(tuned, tmp_path):
    """The "Use it" snippet is real code: run it (pointed at the unzipped folder) and it prints the
    greedy answer, which equals the registered model's."""
    import contextlib

    from model_core import load_model

    name, path = tuned["name"], tuned["res"].path
    buf = io.BytesIO()
    write_model_zip(path, buf, model_card(json.loads((path / "lmscope.json").read_text()), name))
    zipfile.ZipFile(io.BytesIO(buf.getvalue())).extractall(tmp_path)
    card = (tmp_path / name / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    assert f'path = "./{name}"' in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace(f'"./{name}"', repr(str(tmp_path / name))), {})
    lm = load_model(name)
    msgs = [{"role": "user", "content": re.search(r'"content": "([^"]+)"', code).group(1)}]
    want = sft.greedy_answers(lm.model, lm.tokenizer, [msgs], max_new_tokens=32)[0]
    assert printed.getvalue() == want + "\n"


class _Unseekable(io.RawIOBase):
    """A write-only stream that cannot seek or tell (a socket, a pipe)."""

    def __init__(self):
        self.buf = bytearray()

    def writable(self):
        return True

    def write(self, b):
        self.buf += b
        return len(b)


def test_zip_streams_to_an_unseekable_file(tuned, tmp_path):
    name, path = tuned["name"], tuned["res"].path
    sink = _Unseekable()
    write_model_zip(path, sink, "# card\n", folder="elsewhere")
    with zipfile.ZipFile(io.BytesIO(bytes(sink.buf))) as z:
        assert z.testzip() is None
        assert z.read("elsewhere/README.md") == b"# card\n"
        assert z.read("elsewhere/model.safetensors") == (path / "model.safetensors").read_bytes()
        z.extractall(tmp_path)
    _check_loads_like_registered(tmp_path / "elsewhere", name)


def test_card_for_lora_and_uploaded_data_names_no_server_path(tuned):
    meta = json.loads((tuned["res"].path / "lmscope.json").read_text())
    meta["training"].update(method="lora", lora_rank=4, lora_alpha=8.0, dataset="/srv/secret/jobs/ab12/input/d.jsonl")
    meta["dataset"] = {"source": "upload", "file": "d.jsonl", "size": 10, "sha256": "9f86d081884c7d65"}
    meta["parent"] = "smollm2-135m-instruct"
    card = model_card(meta, "x")
    assert "- lora" in card.split("---")[1] and '- "HuggingFaceTB/SmolLM2-135M-Instruct"' in card.split("---")[1]
    assert "| method | LoRA, merged into the weights |" in card and "| LoRA rank | 4 |" in card
    assert "| LoRA alpha | 8.0 |" in card
    assert "Uploaded chat JSONL `d.jsonl`, 10 conversations." in card and "Data hash: `9f86d081884c7d65`." in card
    assert "/srv/secret" not in card
    # a record that lost everything still gives a card, not an exception
    bare = model_card({}, "bare")
    assert bare.startswith("---") and "# bare" in bare and "Trained with lmscope." in bare


def test_zip_refuses_a_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no config.json and safetensors"):
        write_model_zip(tmp_path, tmp_path / "x.zip", "# card\n")


# ---- the live route -------------------------------------------------------------------------------------

@pytest.mark.browser
def test_download_route_serves_registered_finetuned_models_only(tuned, tmp_path):
    import httpx

    from tests.helpers.browser import LiveServer

    name = tuned["name"]
    (tuned["data"] / "models" / "not-a-model").mkdir()  # a folder without config.json is no model
    # the data folder itself looks like a model folder: '..' from the models folder must not reach it
    for f in ("config.json", "model.safetensors"):
        (tuned["data"] / f).write_bytes((tuned["res"].path / f).read_bytes())
    scratch = tmp_path / "server-tmp"
    scratch.mkdir()
    server = LiveServer(extra_env={"LMSCOPE_DATA_DIR": str(tuned["data"]), "REDIS_URL": "redis://127.0.0.1:1/0",
                                   "TMPDIR": str(scratch)})
    try:
        with httpx.Client(base_url=server.url.rstrip("/"), timeout=60) as http:
            r = http.get(f"/download/model/{name}.zip")
            assert r.status_code == 200, r.text[:300]
            assert r.headers["content-type"] == "application/zip"
            assert f'filename="{name}.zip"' in r.headers["content-disposition"]
            with zipfile.ZipFile(io.BytesIO(r.content)) as z:
                assert f"{name}/README.md" in z.namelist()
                assert f"fine-tune of **{TINY}**" in z.read(f"{name}/README.md").decode()
                z.extractall(tmp_path / "got")
            _check_loads_like_registered(tmp_path / "got" / name, name)
            for bad in ("..%2F..%2Fetc", "..", "%2E%2E", "unknown-model", TINY, "not-a-model", f"..%2Fmodels%2F{name}",
                        f"{name}%2F..%2F.."):
                r = http.get(f"/download/model/{bad}.zip")
                assert r.status_code == 404, (bad, r.status_code, r.text[:200])
                assert not r.content.startswith(b"PK"), bad
        # the temporary zip is deleted once it has been sent
        deadline = time.time() + 10
        while list(scratch.glob("lmscope-model-*")) and time.time() < deadline:
            time.sleep(0.1)
        assert not list(scratch.glob("lmscope-model-*"))
    finally:
        server.stop()


@pytest.mark.browser
def test_download_route_needs_sign_in_when_it_is_on(tuned, tmp_path):
    import httpx

    from app.server import auth
    from tests.helpers.browser import LiveServer

    users = tmp_path / "users.txt"
    auth.write_user(users, "user-a", "user-a-password", iterations=2000)
    server = LiveServer(extra_env={"LMSCOPE_DATA_DIR": str(tuned["data"]), "REDIS_URL": "redis://127.0.0.1:1/0",
                                   "LMSCOPE_AUTH": "users", "LMSCOPE_USERS_FILE": str(users)})
    try:
        url = f"/download/model/{tuned['name']}.zip"
        with httpx.Client(base_url=server.url.rstrip("/"), timeout=60) as anon:
            assert anon.get(url).status_code == 401
            assert anon.get("/download/model/unknown.zip").status_code == 401  # no hint without sign-in
        with httpx.Client(base_url=server.url.rstrip("/"), timeout=60) as a:
            assert a.post("/login", data={"username": "user-a", "password": "user-a-password"}).status_code == 200
            r = a.get(url)  # a fine-tuned model is shared: user-a did not train it and may take it
            assert r.status_code == 200 and zipfile.ZipFile(io.BytesIO(r.content)).testzip() is None
            assert a.get("/download/model/unknown.zip").status_code == 404
    finally:
        server.stop()


# ---- TensorBoard ---------------------------------------------------------------------------------------

def read_events(path: Path) -> list:
    """Every Event of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    raw, events, i = path.read_bytes(), [], 0
    while i < len(raw):
        (n,) = struct.unpack("<Q", raw[i:i + 8])
        events.append(event_pb2.Event.FromString(raw[i + 12:i + 12 + n]))
        i += 12 + n + 4
    return events


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for f in sorted(folder.rglob("events.out.tfevents.*")):
        for e in read_events(f):
            for v in e.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((e.step, v.simple_value))
    return out


def texts(folder: Path) -> dict[str, str]:
    out = {}
    for f in sorted(folder.rglob("events.out.tfevents.*")):
        for e in read_events(f):
            for v in e.summary.value:
                if v.HasField("tensor") and v.tensor.string_val:
                    out[v.tag] = v.tensor.string_val[0].decode()
    return out


def test_sft_writes_tensorboard_scalars_equal_to_its_history(tuned):
    folder = tuned["base"] / "tb" / tuned["name"]
    got = scalars(folder)
    train = [(r["step"], r["loss"]) for r in tuned["rows"] if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in tuned["rows"]
             if r.get("eval_loss") is not None and r.get("loss") is None]
    assert [s for s, _ in train] == [1, 2] and len(evals) == 2
    assert [s for s, _ in got["train/loss"]] == [1, 2]
    assert got["train/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in train]
    assert got["eval/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in evals]
    assert [s for s, _ in got["train/learning_rate"]] == [1, 2] and "train/grad_norm" in got
    settings = json.loads(texts(folder)["lmscope/settings/text_summary"])
    assert settings["model"] == TINY and settings["max_steps"] == 2 and settings["seed"] == 3
    assert "args/text_summary" not in texts(folder)  # TrainingArguments would name the staging folder


@pytest.mark.integration
def test_sft_job_registers_tensorboard_zip(tmp_path):
    from tasks import config, jobs
    from tests.helpers.services import LiveServices

    svc = LiveServices(tmp_path / "jobs-data", stale_s=6.0).start()
    try:
        name = f"tiny-tb-{uuid.uuid4().hex[:6]}"
        rec = jobs.submit("sft", {**RUN, "max_steps": 3, "accuracy_examples": 0, "output_name": name}, owner="t")
        done = jobs.wait_job(rec["id"], timeout=120, poll=0.2)
        assert done["state"] == "succeeded", (done, svc.worker_log())
        art = {a["name"]: a for a in done["artifacts"]}
        assert "tensorboard.zip" in art
        path = jobs.artifact_path(done, "tensorboard.zip")  # what /download/{job}/tensorboard.zip serves
        assert path is not None and path.parent == config.job_dir(rec["id"]).resolve()
        with zipfile.ZipFile(path) as z:
            assert all(n.startswith(f"tensorboard/{name}/events.out.tfevents.") for n in z.namelist())
            z.extractall(tmp_path / "tb")
        got = scalars(tmp_path / "tb" / "tensorboard" / name)
        hist = [(h["step"], h["loss"]) for h in done["sft"]["history"] if h.get("loss") is not None]
        assert got["train/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in hist] and len(hist) == 3
    finally:
        svc.stop()
