"""Reward model, DPO and GRPO (model_core.training.preference on TRL's trainers) against references no one here
wrote: the published loss formulas, computed by hand from log-probs and scores that a plain forward
pass (transformers' own `labels=` loss, the model's own score head) gives for the very batch TRL
trained on; GRPO's group-relative advantages recomputed from the rewards TRL logged; the per-token
log-ratio view against the sequence log-ratio; malformed uploads reported by line number.

All on random-weight tiny models (byte tokenizer, lmscope's simple chat template), one or two
optimizer steps each, so the file stays well under a minute on two shared cores."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from model_core.training import preference as P
from model_core.training import preference_data as D
from model_core.training import sft

POLICY = "random-llama-tiny"
OTHER = "random-gpt2-tiny"  # same byte tokenizer, other weights: a reference that differs from the policy


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("pref") / "data"
    mp.setenv("LMSCOPE_DATA_DIR", str(d))
    yield d
    mp.undo()


def _pairs(n: int) -> D.PreferenceData:
    """Date pairs only: short texts, so a byte-level batch is small."""
    built = D.builtin_preferences(n, 2, seed=3, sets=("date",))
    return D.PreferenceData(built.train, built.test, {"source": "test"})


def _template(prompt: str, answer: str | None = None) -> str:
    """sft.SIMPLE_CHAT_TEMPLATE written out by hand: 'role: content<eos>\\n' per turn, then
    'assistant: ' as the generation prompt."""
    if answer is None:
        return f"user: {prompt}<eos>\nassistant: "
    return f"user: {prompt}<eos>\nassistant: {answer}<eos>\n"


def _summed_logp(model, tok, prompt: str, answer: str) -> float:
    """log pi(answer | prompt) summed over the answer's tokens, from transformers' own labels= loss
    (mean cross-entropy over the unmasked labels) on the templated text."""
    p = tok(_template(prompt), add_special_tokens=False)["input_ids"]
    full = tok(_template(prompt, answer), add_special_tokens=False)["input_ids"]
    assert full[: len(p)] == p
    labels = torch.tensor([[-100] * len(p) + full[len(p):]])
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([full]), labels=labels).loss
    return -float(loss) * (len(full) - len(p))


@pytest.fixture(scope="module")
def dpo_run(data_dir):
    """One DPO step of random-llama-tiny against random-gpt2-tiny as the reference, on one batch
    holding the whole (6-pair) train set."""
    data = _pairs(6)
    rows = []
    res = P.train_dpo(POLICY, data, {"reference": OTHER, "beta": 2.0, "max_steps": 1, "batch_size": 6,
                                     "eval_examples": 0, "output_name": "t-dpo", "learning_rate": 1e-3},
                      progress=lambda step, total, m: rows.append((step, total, m)))
    return res, data, rows


def test_dpo_loss_equals_formula_from_plain_forward_logps(dpo_run):
    """Reference: the DPO loss (Rafailov et al. 2023, eq. 7)
    -log sigmoid(beta * ((log pi(y_c|x) - log pi_ref(y_c|x)) - (log pi(y_r|x) - log pi_ref(y_r|x)))),
    averaged over the batch, with every log-prob from transformers' labels= loss of the untouched
    models; compared with the loss TRL's DPOTrainer computed and logged for that batch (step 1,
    before any update)."""
    res, data, rows = dpo_run
    policy, tok, _ = sft.load_trainable(POLICY, "cpu")
    ref, _, _ = sft.load_trainable(OTHER, "cpu")
    policy.eval(), ref.eval()
    beta = 2.0
    losses, margins, logp_c, rewards_c = [], [], [], []
    for p in data.train:
        pc, pr = _summed_logp(policy, tok, p.prompt, p.chosen), _summed_logp(policy, tok, p.prompt, p.rejected)
        rc, rr = _summed_logp(ref, tok, p.prompt, p.chosen), _summed_logp(ref, tok, p.prompt, p.rejected)
        z = beta * ((pc - rc) - (pr - rr))
        losses.append(-F.logsigmoid(torch.tensor(z, dtype=torch.float64)).item())
        margins.append(z)
        logp_c.append(pc)
        rewards_c.append(beta * (pc - rc))
    n = len(losses)
    step1 = res.history[0]
    assert step1["step"] == 1
    assert step1["loss"] == pytest.approx(sum(losses) / n, rel=1e-4)
    assert step1["margin"] == pytest.approx(sum(margins) / n, rel=1e-4, abs=1e-4)
    assert step1["accuracy"] == pytest.approx(sum(m > 0 for m in margins) / n)
    assert step1["logp_chosen"] == pytest.approx(sum(logp_c) / n, rel=1e-4)
    assert step1["reward_chosen"] == pytest.approx(sum(rewards_c) / n, rel=1e-4, abs=1e-4)
    # the loss is not at its trivial value log 2 (policy != reference), so the check has teeth
    assert abs(step1["loss"] - math.log(2)) > 1e-2
    # progress(step, total, metrics) saw the step, and the run registered a model with its record
    assert any(s == 1 and t == 1 and m.get("loss") == step1["loss"] for s, t, m in rows)
    info = json.loads((res.path / "lmscope.json").read_text())
    assert info["kind"] == "dpo" and info["parent"] == POLICY and info["reference"] == OTHER
    assert info["dataset"]["hash"] == data.data_hash() and info["training"]["beta"] == 2.0


def test_token_logratios_sum_to_the_sequence_logratio(dpo_run):
    """Reference: the sequence log-ratio log pi(y|x) - log pi_ref(y|x) from transformers' labels= loss
    of each model; the per-token view (the DPO-trained model, opened by name through the registry,
    against its parent) must add up to it, token for token of the answer plus '<eos>\\n'."""
    from model_core import load_model

    res, data, _ = dpo_run
    tuned, parent = load_model(res.name), load_model(POLICY)
    p = data.train[0]
    view = P.token_logratios(tuned, parent, p.prompt, p.chosen)
    tok = parent.tokenizer
    want = _summed_logp(tuned.model, tok, p.prompt, p.chosen) - _summed_logp(parent.model, tok, p.prompt, p.chosen)
    assert sum(t["logratio"] for t in view["tokens"]) == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert view["total"] == pytest.approx(want, rel=1e-4, abs=1e-4)
    assert "".join(t["text"] for t in view["tokens"]) == p.chosen + "<eos>\n"
    assert abs(want) > 1e-3  # one step at lr 1e-3 moved it


def test_bradley_terry_loss_equals_formula_from_the_score_head(data_dir):
    """Reference: the Bradley-Terry loss -log sigmoid(r(x, y_c) - r(x, y_r)) (Ouyang et al. 2022, eq. 1)
    averaged over the batch, with r read from the reward model's own score head on each templated
    conversation alone (no padding); compared with the loss TRL's RewardTrainer logged at step 1.
    Then the registered reward model loads and scores as the trained one does."""
    data = _pairs(6)
    res = P.train_reward(POLICY, data, {"max_steps": 1, "batch_size": 6, "eval_examples": 0, "seed": 5,
                                        "output_name": "t-rm", "learning_rate": 1e-2})
    causal, tok, _ = sft.load_trainable(POLICY, "cpu")
    sft.ensure_chat_template(tok)
    rm = P.init_reward_model(causal, tok, seed=5).eval()

    def r(prompt, answer):
        ids = tok(_template(prompt, answer), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            return float(rm(input_ids=torch.tensor([ids])).logits[0, 0])

    d = [r(p.prompt, p.chosen) - r(p.prompt, p.rejected) for p in data.train]
    bt = sum(-F.logsigmoid(torch.tensor(x, dtype=torch.float64)).item() for x in d) / len(d)
    step1 = res.history[0]
    assert step1["loss"] == pytest.approx(bt, rel=1e-4)
    assert step1["margin"] == pytest.approx(sum(d) / len(d), rel=1e-3, abs=1e-5)
    assert step1["accuracy"] == pytest.approx(sum(x > 0 for x in d) / len(d))
    # the registered model is the trained one: its scores differ from the fresh head's
    loaded, ltok = P.load_reward_model(res.name)
    s_loaded = P.reward_scores(loaded, ltok, [(p.prompt, p.chosen) for p in data.train])
    assert any(abs(a - r(p.prompt, p.chosen)) > 1e-4 for a, p in zip(s_loaded, data.train))
    assert json.loads((res.path / "lmscope.json").read_text())["kind"] == "reward"


def _ascii_share(completion: str, answer: str) -> float:
    """A test reward with spread on random-weight text: the share of ASCII letters in the answer."""
    return sum(c.isascii() and c.isalpha() for c in completion) / max(1, len(completion))


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_grpo_advantages_are_group_relative(data_dir, monkeypatch, loss_type):
    """Reference: GRPO's advantage (Shao et al. 2024, DeepSeekMath, eq. 3 with outcome rewards)
    A_i = (r_i - mean(r)) / std(r) over the G completions of one prompt; Dr. GRPO (Liu et al. 2025)
    drops the division: A_i = r_i - mean(r). Recomputed from the rewards TRL logged and compared
    with the advantages TRL computed and trained with (TRL adds 1e-4 to the std; std has Bessel's
    correction as torch.std)."""
    monkeypatch.setitem(D.VERIFIERS, "ascii-share", D.Verifier("ascii-share", _ascii_share, "test"))
    tasks = [D.Task(f"Say something about {w}.", "", "ascii-share") for w in ("cats", "rain", "maps", "tea")]
    data = D.TaskData(tasks, [], {"source": "test"})
    res = P.train_grpo(POLICY, data, {"loss_type": loss_type, "max_steps": 2, "num_generations": 4,
                                      "prompts_per_step": 2, "max_completion_length": 8, "eval_examples": 0,
                                      "beta": 0.0, "output_name": f"t-grpo-{loss_type}"})
    seen = 0
    for row in res.history:
        assert len(row["groups"]) == 2
        for g in row["groups"]:
            r = torch.tensor(g["rewards"], dtype=torch.float64)
            a = torch.tensor(g["advantages"], dtype=torch.float64)
            if r.std() < 0.05:
                continue
            want = (r - r.mean()) / r.std() if loss_type == "grpo" else r - r.mean()
            assert a.tolist() == pytest.approx(want.tolist(), rel=2e-3, abs=1e-6)
            assert g["mean"] == pytest.approx(float(r.mean())) and g["std"] == pytest.approx(float(r.std()))
            seen += 1
    assert seen >= 2  # groups with spread were checked
    assert json.loads((res.path / "lmscope.json").read_text())["training"]["loss_type"] == loss_type


def test_cancel_registers_nothing(data_dir):
    tasks = D.builtin_tasks(4, 0)
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 3

    with pytest.raises(sft.SFTCancelled):
        P.train_grpo(POLICY, tasks, {"max_steps": 5, "num_generations": 2, "prompts_per_step": 1,
                                     "max_completion_length": 4, "eval_examples": 0, "output_name": "t-cancel"},
                     should_stop=stop)
    assert not (data_dir / "models" / "t-cancel").exists()
    assert not any((data_dir / "preference-staging").iterdir())


# ---- data -----------------------------------------------------------------------------------------

def test_malformed_preference_lines_reported_by_number(data_dir, tmp_path):
    """Every bad line found before anything runs, each with its number and one sentence."""
    lines = [
        json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}),  # 1 good
        '{"prompt": "a", "chosen": "b", ',  # 2 broken JSON
        json.dumps({"prompt": "a", "chosen": "b"}),  # 3 no rejected
        "",  # blank: skipped, still counted in the numbering
        json.dumps(["prompt", "chosen"]),  # 5 not an object
        json.dumps({"prompt": "a", "chosen": 3, "rejected": "c"}),  # 6 not a string
        json.dumps({"prompt": "a", "chosen": "same", "rejected": " same "}),  # 7 nothing to prefer
        json.dumps({"prompt": " ", "chosen": "b", "rejected": "c"}),  # 8 empty prompt
        json.dumps({"prompt": "q", "chosen": "b", "rejected": "c"}),  # 9 good
    ]
    f = tmp_path / "prefs.jsonl"
    f.write_text("\n".join(lines) + "\n")
    calls = []
    with pytest.raises(D.PreferenceDataError) as e:
        P.train_dpo(POLICY, str(f), {"max_steps": 1}, progress=lambda *a: calls.append(a))
    assert calls == []  # raised before the model was even loaded
    assert [n for n, _ in e.value.lines] == [2, 3, 5, 6, 7, 8]
    for _n, why in e.value.lines:
        assert why.endswith(".") and "\n" not in why and why.count(". ") == 0, why
    for n, why in e.value.lines[: D.MAX_ERRORS_SHOWN]:  # the message shows the first five, then a count
        assert f"Line {n}: {why}" in str(e.value)
    assert str(e.value).endswith("And 1 more malformed line.")
    assert "missing 'rejected'" in dict(e.value.lines)[3]
    assert "same text" in dict(e.value.lines)[7]
    assert str(e.value).startswith("6 of 8 lines in 'prefs.jsonl' are malformed")


def test_malformed_task_lines_reported_by_number(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join([
        json.dumps({"prompt": "2+2?", "answer": 4}),  # 1 good (number verifier)
        json.dumps({"prompt": "2+2?", "answer": "four"}),  # 2 not a number
        json.dumps({"prompt": "2+2?"}),  # 3 no answer
        json.dumps({"prompt": "x", "answer": "1", "verifier": "vibes"}),  # 4 unknown verifier
        json.dumps({"prompt": "d", "answer": "2024-01-02", "verifier": "date"}),  # 5 not DD/MM/YYYY
        "nope",  # 6 broken JSON
    ]))
    with pytest.raises(D.PreferenceDataError) as e:
        D.load_task_jsonl(f, verifier="number")
    assert [n for n, _ in e.value.lines] == [2, 3, 4, 5, 6]
    with pytest.raises(D.PreferenceDataError, match="Unknown verifier"):
        D.load_task_jsonl(f, verifier="nonsense")


def test_builtin_data_is_seeded_and_held_out():
    a, b = D.builtin_preferences(40, 10, seed=1), D.builtin_preferences(40, 10, seed=1)
    assert a.data_hash() == b.data_hash() != D.builtin_preferences(40, 10, seed=2).data_hash()
    assert not {p.prompt for p in a.test} & {p.prompt for p in a.train}
    assert all(p.chosen != p.rejected for p in a.train + a.test)
    swaps = [p for p in a.train if p.kind == "date/swap"]
    assert swaps and all(p.rejected.split("/")[:2] == p.chosen.split("/")[:2][::-1] for p in swaps)
    t = D.builtin_tasks(30, 10)
    assert not {x.prompt for x in t.test} & {x.prompt for x in t.train}
    assert all(D.score(x.answer, x.answer, x.verifier) == 1.0 for x in t.train)
    # the verifiers are plain code: a few cases by hand
    assert D.verify_number("7 + 5 = 12", "12") == 1.0 and D.verify_number("12 is not 13", "12") == 0.0
    assert D.verify_date(" 09/04/2023. ", "09/04/2023") == 1.0 and D.verify_date("9/4/2023", "09/04/2023") == 0.0
