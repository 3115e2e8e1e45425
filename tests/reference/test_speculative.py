"""Greedy speculative decoding through the CLI on the real default model, checked against
transformers' own greedy `generate` (AutoModelForCausalLM loaded by transformers, not lmscope's copy):
with prompt lookup and with a draft model (the default model cut after its first 12 of 30 layers, the
final norm and unembedding kept: a self-speculative draft on the same tokenizer) the tokens are the
target's greedy tokens, token for token; the run reports what it accepted. Bad combinations are one
sentence and load nothing."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import DEFAULT
from model_core.core.registry import REGISTRY, convert_gguf

PROMPTS = [
    # code that repeats its own pattern: prompt lookup finds what comes next in the prompt
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
]
N = 32


@pytest.fixture(scope="module")
def hf():
    path = convert_gguf(REGISTRY[DEFAULT])
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def cut_draft(tmp_path_factory):
    """The default model's first 12 layers (transformers loads the checkpoint with num_hidden_layers=12
    and drops the rest), saved by transformers with the default model's tokenizer."""
    path = convert_gguf(REGISTRY[DEFAULT])
    out = tmp_path_factory.mktemp("draft") / "smollm2-first-12-layers"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, num_hidden_layers=12).save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return str(out)


def _reference(hf, ids: list[int]) -> list[int]:
    model, _ = hf
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False)
    return out[0, len(ids):].tolist()  # stops at EOS as lmscope does


def _cli(capsys, *args) -> dict:
    from app.server.cli import main

    assert main(["generate", *args, "--max-new-tokens", str(N), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["runs"][0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_decoding_is_transformers_greedy(default_lm, hf, cut_draft, prompt, capsys):
    lookup = _cli(capsys, prompt, "--prompt-lookup", "5")
    want = _reference(hf, lookup["prompt_token_ids"])
    assert lookup["token_ids"] == want and lookup["equals_plain"] and lookup["plain"]["token_ids"] == want
    drafted = _cli(capsys, prompt, "--assistant-model", cut_draft, "--draft-tokens", "4")
    assert drafted["token_ids"] == want and drafted["equals_plain"]
    for run in (lookup, drafted):
        # each step: the accepted proposals are the next tokens, then the target's own token
        steps, ids = run["steps"], run["token_ids"]
        assert run["target_forwards"] == 1 + len(steps) and run["accepted"] == sum(s["accepted"] for s in steps)
        for s in steps:
            assert ids[s["at"]:s["at"] + s["accepted"]] == s["proposed"][:s["accepted"]]
            if s["at"] + s["accepted"] < len(ids):
                assert ids[s["at"] + s["accepted"]] == s["token"]
    assert len(want) == N  # no early EOS: every step of both runs is checked
    # the cut model guesses a few (3 of 102 and 5 of 98 proposals when this was written)
    assert drafted["accepted"] > 0 and drafted["target_forwards"] < len(want)
    if prompt == PROMPTS[0]:
        assert lookup["accepted"] > 0  # " return a" follows "(a, b):\n" earlier in the prompt


@pytest.mark.parametrize("args, says", [
    (["--prompt-lookup", "4", "--assistant-model", "x"], "not both"),
    (["--prompt-lookup", "4", "--temperature", "0.7"], "greedy"),
    (["--prompt-lookup", "4", "--frequency-penalty", "0.5"], "greedy"),
    (["--prompt-lookup", "0"], "from 1 to 32"),
    (["--assistant-model", "no-such-model", "--draft-tokens", "99"], "from 1 to 32"),
    (["--prompt-lookup", "4", "--num-beams", "2"], "does not combine"),
])
def test_bad_combinations_are_one_sentence(args, says, capsys):
    from app.server.cli import main

    assert main(["generate", "hi", "--model", "no-such-model-anywhere", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and says in err and "\n" not in err


def test_a_draft_with_another_tokenizer_is_one_sentence(default_lm, capsys):
    from app.server.cli import main

    assert main(["generate", "hi", "--assistant-model", "random-llama-tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has another tokenizer" in err and "\n" not in err
