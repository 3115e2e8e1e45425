"""SFT on tiny random-weight models: the loss mask on a byte template, bad data, MFU arithmetic, tiny
end-to-end runs (full and LoRA) that register loadable models, cancel and NaN that register nothing.
The mask on the real SmolLM2 template: tests/reference/test_sft_loss_mask.py; a job through a real
worker: tests/integration/test_sft_job.py."""

from __future__ import annotations

import json

import pytest
import torch

from model_core.training import sft

TINY = "random-llama-tiny"
TINY_RUN = {"model": TINY, "dataset": "builtin", "batch_size": 8,
            "learning_rate": 3e-3, "accuracy_examples": 4, "eval_fraction": 0.1}


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LMSCOPE_DATA_DIR", str(tmp_path / "data"))
    return tmp_path / "data"


# ---- the loss mask ---------------------------------------------------------------------------

def test_loss_mask_byte_template_and_prompt_completion():
    from model_core.core.tokenization import byte_tokenizer

    tok = byte_tokenizer()
    assert sft.ensure_chat_template(tok) is True
    msgs = sft.parse_example({"prompt": "2+2?", "completion": "4"})
    ex = sft.encode_conversation(tok, msgs)
    text = "".join(tok.decode([t]) for t in ex["input_ids"])
    assert text == "user: 2+2?<eos>\nassistant: 4<eos>\n"
    kept = [tok.decode([t]) for t, m in zip(ex["input_ids"], ex["assistant_mask"]) if m]
    assert kept == ["4", "<eos>"]


# ---- bad data ----------------------------------------------------------------------------------

def test_malformed_jsonl_names_line_numbers(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        '{"messages": [',  # line 2: broken JSON
        json.dumps({"messages": [{"role": "user", "content": "q"}]}),  # line 3: no assistant turn
        "",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),  # line 5: bad role
        json.dumps({"text": "x"}),  # line 6: wrong keys
        json.dumps({"prompt": "q", "completion": "a"}),
    ]) + "\n")
    with pytest.raises(sft.DatasetError) as e:
        sft.load_jsonl(p)
    msg = str(e.value)
    assert msg.startswith("4 malformed line(s) in 'bad.jsonl'")
    assert "line 2: not valid JSON" in msg and "line 3: no assistant turn" in msg
    assert "line 5: message 1 has role 'robot'" in msg and "line 6: needs 'messages'" in msg
    assert "line 1" not in msg and "line 7" not in msg
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "q", "completion": "a"}) + "\n\n")
    assert sft.load_jsonl(good) == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(sft.DatasetError, match="no examples"):
        sft.load_jsonl(empty)


def test_settings_are_checked():
    with pytest.raises(sft.SettingsError, match="learning_rate"):
        sft.validate_settings({"learning_rate": "fast"})
    with pytest.raises(sft.SettingsError, match="Method"):
        sft.validate_settings({"method": "qlora"})
    with pytest.raises(sft.SettingsError, match="output name"):
        sft.validate_settings({"output_name": "../evil"})
    with pytest.raises(sft.SettingsError, match="Unknown SFT setting"):
        sft.validate_settings({"lr": 1})
    s = sft.validate_settings({"method": "lora", "lora_rank": 4})
    assert s.lr() == 1e-3 and s.to_json()["lora_alpha"] == 8
    with pytest.raises(sft.SettingsError, match="'loader_workers' must be between 0 and 16"):
        sft.validate_settings({"loader_workers": 64})
    # unset, the loader gets processes on a GPU and none on the CPU, where they would take the step's cores
    assert sft.loader_workers(s, use_cuda=True) == 2 and sft.loader_workers(s, use_cuda=False) == 0
    assert sft.loader_workers(sft.validate_settings({"loader_workers": "0"}), use_cuda=True) == 0


def test_builtin_dataset_is_deterministic_and_disjoint():
    train, test = sft.builtin_dataset(200, 50, seed=0)
    assert sft.builtin_dataset(200, 50, seed=0) == (train, test)
    qs = {c[0]["content"] for c in train}
    assert len(qs) == 200 and not qs & {p[0]["content"] for p, _ in test}
    q, a = test[0][0][0]["content"], test[0][1]
    y, m, d = q.split("date ")[1].split(" ")[0].split("-")
    assert a == f"{d}/{m}/{y}"


# ---- MFU -----------------------------------------------------------------------------------------

def test_mfu_worked_example():
    # 6 x 125M parameters x 200k tokens/s = 1.5e17 FLOP/s of a 312 TFLOP/s peak
    assert sft.mfu(125e6, 200e3, 312e12) == pytest.approx(0.4808, abs=1e-4)
    assert round(sft.mfu(125e6, 200e3, 312e12), 2) == 0.48


# ---- end to end on the tiny random model -------------------------------------------------------

def test_tiny_full_sft_registers_a_loadable_model(data_dir):
    from model_core import list_models, load_model, trace

    rows = []
    res = sft.run_sft({**TINY_RUN, "max_steps": 24, "output_name": "tiny-full", "eval_every": 12},
                      progress=rows.append)
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    assert len(losses) == 24
    assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:4]) / 4, losses
    evals = [r["eval_loss"] for r in rows if r.get("eval_loss") is not None and r.get("loss") is None]
    assert len(evals) == 2 and evals[1] < evals[0]
    last = [r for r in rows if r.get("loss") is not None][-1]
    assert last["step"] == 24 and last["tokens_per_s"] > 0 and last["lr"] is not None and last["eta_s"] == 0
    path = data_dir / "models" / "tiny-full"
    assert res.path == path and (path / "model.safetensors").exists() and (path / "chat_template.jinja").exists()
    info = json.loads((path / "lmscope.json").read_text())
    assert info["parent"] == TINY and info["parameters"] > 0 and info["training"]["max_steps"] == 24
    assert info["accuracy_before"]["n"] == 4 and info["accuracy_after"]["n"] == 4
    assert not any((data_dir / "sft-staging").iterdir())
    lm = load_model("tiny-full")
    assert lm.source == "finetuned" and lm.meta["parent"] == TINY and lm.has_chat_template
    tr = trace(lm, "Rewrite the date 2001-02-03", chat=True)
    assert tr.n_tokens > 10 and torch.isfinite(tr.next_logits).all()
    assert {"name": "tiny-full", "parent": TINY}.items() <= next(
        r for r in list_models() if r["name"] == "tiny-full").items()
    with pytest.raises(sft.SFTError, match="already exists"):
        sft.run_sft({**TINY_RUN, "max_steps": 1, "output_name": "tiny-full"})


def test_the_trainers_first_loss_is_transformers_loss_on_the_assistant_tokens(data_dir):
    """SFTTrainer trains on our labels as they are: its first logged loss (one step over the whole
    8-example set, so the batch is known whatever the shuffle) equals transformers' own `labels=` loss
    of the untrained model on that batch with -100 outside the assistant turns, and not the loss over
    every token (what a trainer that rebuilt the labels from input_ids would log)."""
    run = {**TINY_RUN, "builtin_train_size": 8, "eval_fraction": 0.0, "accuracy_examples": 0, "sample_every": 0,
           "max_steps": 1, "learning_rate": 1e-6, "output_name": "tiny-first-loss"}
    rows = []
    sft.run_sft(run, progress=rows.append)
    logged = next(r["loss"] for r in rows if r.get("loss") is not None)
    model, tok, _ = sft.load_trainable(TINY, "cpu")
    sft.ensure_chat_template(tok)
    train, _ev, _test, _desc = sft.prepare_data(sft.validate_settings(run), tok)
    assert len(train.examples) == 8
    T = max(len(e["input_ids"]) for e in train.examples)
    ids = torch.tensor([e["input_ids"] + [tok.pad_token_id] * (T - len(e["input_ids"])) for e in train.examples])
    labels = torch.tensor([e["labels"] + [-100] * (T - len(e["labels"])) for e in train.examples])
    att = (torch.arange(T)[None, :] < torch.tensor([len(e["input_ids"]) for e in train.examples])[:, None]).long()
    model.eval()
    with torch.no_grad():
        masked = float(model(input_ids=ids, attention_mask=att, labels=labels).loss)
        every = float(model(input_ids=ids, attention_mask=att, labels=ids.masked_fill(att == 0, -100)).loss)
    assert abs(logged - masked) < 1e-5 < 1e-3 < abs(every - masked)  # a random model's losses are close: told apart


def test_tiny_lora_is_merged_into_a_plain_checkpoint(data_dir):
    from model_core import load_model

    res = sft.run_sft({**TINY_RUN, "method": "lora", "lora_rank": 4, "max_steps": 6, "learning_rate": 1e-2,
                       "accuracy_examples": 0, "output_name": "tiny-lora"})
    files = {p.name for p in res.path.iterdir()}
    assert "adapter_config.json" not in files and "model.safetensors" in files
    ft, base = load_model("tiny-lora"), load_model(TINY)
    assert ft.n_params == base.n_params
    diff = [n for (n, a), (_, b) in zip(ft.model.named_parameters(), base.model.named_parameters())
            if not torch.equal(a, b)]
    assert diff and all("proj" in n for n in diff)  # LoRA touched the linear layers only
    assert res.info["training"]["method"] == "lora" and res.info["training"]["lora_rank"] == 4


def test_cancel_mid_run_registers_nothing(data_dir):
    seen = []

    def stop():
        return len(seen) >= 3

    with pytest.raises(sft.SFTCancelled):
        sft.run_sft({**TINY_RUN, "max_steps": 50, "output_name": "tiny-cancel", "accuracy_examples": 0},
                    progress=lambda r: seen.append(r) if r.get("loss") is not None else None, should_stop=stop)
    assert 3 <= len(seen) < 50
    assert not (data_dir / "models" / "tiny-cancel").exists()
    assert not any((data_dir / "sft-staging").iterdir())


def test_nan_loss_stops_with_a_clear_error(data_dir, tmp_path):
    from model_core import load_model

    lm = load_model(TINY)
    bad = tmp_path / "nan-model"
    sd = {k: v.clone() for k, v in lm.model.state_dict().items()}
    sd["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    lm.model.save_pretrained(bad, state_dict=sd)
    lm.tokenizer.save_pretrained(bad)
    with pytest.raises(sft.SFTError, match="NaN/inf at step 1"):
        sft.run_sft({**TINY_RUN, "model": str(bad), "max_steps": 5, "accuracy_examples": 0, "output_name": "nan"})
    assert not (data_dir / "models" / "nan").exists()
