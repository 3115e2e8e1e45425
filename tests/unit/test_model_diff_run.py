"""model_core.interp.model_diff_run on a tiny random Llama: KL(base || model at a step) across a run's
checkpoints. The base at step 0 and a checkpoint equal to it give exactly 0; each point equals the KL
computed from transformers' own logits of the two models (the reference), and the final point equals
diff_prompt's per-token KL for the same prompt exactly; bad input is one sentence."""

from __future__ import annotations

import pytest
import torch

from model_core import load_model
from model_core.core.errors import SettingsError
from model_core.interp import model_diff_run as R
from model_core.interp.model_diff import diff_prompt

TINY = "random-llama-tiny"
PROMPTS = ["The quick brown fox jumps over the lazy dog", "2024-03-15 is 15/03/2024"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The tiny model as a base, a 'checkpoint' equal to it, and two that move further from it
    (layer 0's MLP scaled by 1.5 and by 3), each saved and loaded by transformers."""
    lm = load_model(TINY)
    root = tmp_path_factory.mktemp("run")
    out = []
    for name, scale in (("same", 1.0), ("mid", 1.5), ("late", 3.0)):
        lm.model.save_pretrained(root / name)
        lm.tokenizer.save_pretrained(root / name)
        m = load_model(str(root / name))
        with torch.no_grad():
            m.model.model.layers[0].mlp.down_proj.weight.mul_(scale)
        out.append(m)
    return lm, out


def _kl_reference(base, other, text: str) -> torch.Tensor:
    ids = torch.tensor([base.tokenizer(text)["input_ids"]])
    with torch.no_grad():
        lb = torch.log_softmax(base.model(ids).logits[0].double(), -1)
        lt = torch.log_softmax(other.model(ids).logits[0].double(), -1)
    return (lb.exp() * (lb - lt)).sum(-1)


def test_curves_are_zero_at_the_base_and_equal_transformers_at_each_step(run):
    base, (same, mid, late) = run
    r = R.kl_across_run(base, [(2, same), (4, mid), (6, lambda: late)], prompts=PROMPTS)
    assert r.steps == [0, 2, 4, 6] and r.models[0] == base.name and r.models[-1] == late.name
    assert len(r.kl) == 4 and all(len(per) == len(PROMPTS) for per in r.kl)
    # the base and a checkpoint equal to it: exactly 0 at every token
    assert all(v == 0.0 for row in r.kl[0] + r.kl[1] for v in row)
    for step, model in ((2, mid), (3, late)):
        for p, text in enumerate(PROMPTS):
            ref = _kl_reference(base, model, text)
            got = torch.tensor(r.kl[step][p], dtype=torch.float64)
            assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-9), (got, ref)
            assert r.mean_kl[step][p] == pytest.approx(float(ref.mean()), abs=1e-9)
    # a larger change is further from the base on both prompts, and the final point is diff_prompt's
    assert all(r.mean_kl[3][p] > r.mean_kl[2][p] > 0 for p in range(len(PROMPTS)))
    assert r.kl[3][0] == diff_prompt(base, late, PROMPTS[0]).kl


def test_bad_input_is_one_sentence(run):
    base, (same, _, _) = run
    with pytest.raises(SettingsError, match="at least one prompt"):
        R.kl_across_run(base, [(1, same)], prompts=["   "])
    with pytest.raises(SettingsError, match="kept no checkpoints"):
        R.kl_across_run(base, [], prompts=PROMPTS)
    with pytest.raises(SettingsError, match="at most 16 prompts"):
        R.kl_across_run(base, [(1, same)], prompts=["a"] * 17)
    with pytest.raises(SettingsError, match="has 3 layers and random-gemma3-tiny 4"):  # same tokenizer, not a run
        R.kl_across_run(base, [(1, load_model("random-gemma3-tiny"))], prompts=PROMPTS)
    assert R.run_checkpoints("no-such-model") == []
