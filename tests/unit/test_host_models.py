"""`lmscope models add NAME PATH` (model_core.core.host_models): the host's own checkpoint by name,
checked before any weight is read, listed with its family and size, opened by name where the
browser may name no path; the same through LMSCOPE_MODELS. The opened model is checked against
transformers' own forward of the same folder."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, BertConfig, GPTNeoXConfig, LlamaConfig

from model_core import load_model, trace
from model_core.core import add_model, host_models
from model_core.core.errors import ModelLoadError
from model_core.core.registry import list_models
from model_core.core.tokenization import byte_tokenizer


@pytest.fixture()
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("LMSCOPE_MODELS", raising=False)
    return tmp_path


def _save(folder, config):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _pythia(tmp_path):
    return _save(tmp_path / "pythia", GPTNeoXConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=128))


def test_added_checkpoint_is_listed_and_opens_by_name(data_dir):
    folder = _pythia(data_dir)
    entry = add_model.add("team-pythia", str(folder))
    assert (entry["architecture"], entry["parameters"]) == ("gpt_neox", 105_472)
    row = next(r for r in list_models() if r["name"] == "team-pythia")
    assert (row["source"], row["architecture"], row["parameters"]) == ("host", "gpt_neox", 105_472)
    # the browser's path: no paths, no hub ids, only names
    lm = load_model("team-pythia", device="cpu", dtype="float32", allow_paths=False, allow_hub=False)
    ids = list(b"a team's own model")
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([ids]), output_hidden_states=True)
    got = trace(lm, token_ids=ids)
    torch.testing.assert_close(got.next_logits, want.logits[0, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.resid_pre[1], want.hidden_states[1][0], atol=1e-4, rtol=1e-4)
    assert host_models.remove("team-pythia") and "team-pythia" not in {r["name"] for r in list_models()}


def test_refused_before_any_weight_is_read(data_dir):
    bert = _save(data_dir / "bert", BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=64, is_decoder=True))
    with pytest.raises(ModelLoadError, match="encoder or encoder-decoder"):
        add_model.add("bert", str(bert))
    with pytest.raises(ModelLoadError, match="neither a model folder"):
        add_model.add("x", str(data_dir / "missing"))
    with pytest.raises(ModelLoadError, match="cannot name a model"):
        add_model.add("../escape", str(_pythia(data_dir)))
    with pytest.raises(ModelLoadError, match="already names a registry model"):
        add_model.add("smollm2-135m-instruct", str(_pythia(data_dir)))
    # ~137B parameters: only the config and an empty weights file exist; the size is read on meta
    huge = data_dir / "huge"
    huge.mkdir()
    LlamaConfig(hidden_size=32768, intermediate_size=131072, num_hidden_layers=8, num_attention_heads=64,
                vocab_size=300).save_pretrained(huge)
    (huge / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"B parameters, .* GiB in float32: more than"):
        add_model.add("huge", str(huge), device="cpu", dtype="float32")
    assert host_models.host_models() == {}


def test_setting_lists_models_for_containers(data_dir, monkeypatch):
    folder = _pythia(data_dir)
    monkeypatch.setenv("LMSCOPE_MODELS", f"env-pythia={folder}")
    row = next(r for r in list_models() if r["name"] == "env-pythia")
    assert (row["source"], row["architecture"]) == ("host", "gpt_neox")
    lm = load_model("env-pythia", device="cpu", dtype="float32", allow_paths=False, allow_hub=False)
    assert lm.source == "host"


def test_cli_add_and_list(data_dir):
    folder = _pythia(data_dir)
    env = {"LMSCOPE_DATA_DIR": str(data_dir / "data"), "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "app.server.cli", "models", *a], capture_output=True,  # noqa: E731
                                    text=True, env=env, timeout=300)
    added = run("add", "cli-pythia", str(folder), "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["architecture"] == "gpt_neox"
    assert "cli-pythia" in run().stdout
    bad = run("add", "nope", str(data_dir / "missing"))
    assert bad.returncode == 1 and bad.stderr.startswith("error: '") and "Traceback" not in bad.stderr
