"""The two tables on a finished SFT run's page that show the same held-out answers: the held-out
accuracy's examples (before / after) and the samples generated while training (step 0 ... last).
They generate to different lengths (the accuracy to the expected answer's length + 4 tokens, the
samples to the run's sampling.max_new_tokens), so the same greedy answer reads '1982-05-05: 19' in
one and '1982-05-05: 1982-05-05' in the other: each table says its limit, and an accuracy answer that
the samples show going on is marked cut. The record is shaped as model_core.training.sft writes it,
with the answers the real default model gave on the built-in task."""

from __future__ import annotations

import re

from app.tabs.finetune.figures import accuracy_examples_html, samples_table_html

PROMPT = "Rewrite the date 1982-05-05 as DD/MM/YYYY. Answer with the date only."
OTHER = "Rewrite the date 1999-05-15 as DD/MM/YYYY. Answer with the date only."


def _record(before_got: str, sample_before: str, after_got: str = "05/05/1982",
            sample_after: str = "05/05/1982") -> dict:
    def example(prompt, got, expected="05/05/1982"):
        return {"prompt": prompt, "expected": expected, "got": got, "correct": got == expected}

    def sample(step, prompt, completion, index):
        return {"step": step, "index": index, "prompt": prompt, "completion": completion, "expected": "05/05/1982",
                "correct": completion.strip() == "05/05/1982"}
    return {"id": "job1", "state": "succeeded", "sft": {
        "accuracy_before": {"accuracy": 0.0, "correct": 0, "n": 2,
                            "examples": [example(PROMPT, before_got), example(OTHER, "15/05/1999", "15/05/1999")]},
        "accuracy_after": {"accuracy": 1.0, "correct": 2, "n": 2,
                           "examples": [example(PROMPT, after_got), example(OTHER, "15/05/1999", "15/05/1999")]},
        "sampling": {"steps": [0, 1, 2], "prompts": 1, "max_new_tokens": 24},
        "samples": [sample(0, PROMPT, sample_before, 0), sample(1, PROMPT, "05/05/1982", 0),
                    sample(2, PROMPT, sample_after, 0)]}}


def _cells(table_html: str) -> list[str]:
    return re.findall(r"<td[^>]*data-cut='(\d)'[^>]*>(.*?)</td>", table_html)


def test_each_table_says_how_far_it_generates():
    rec = _record("1982-05-05: 19", "1982-05-05: 1982-05-05\n\n")
    examples = accuracy_examples_html(rec)
    assert "the expected answer&#x27;s length + 4 tokens" in examples
    assert "run to 24 tokens" in examples
    samples = samples_table_html(rec["sft"]["samples"], rec["sft"]["sampling"]["max_new_tokens"])
    assert "each sample runs to 24 tokens." in samples


def test_a_record_without_its_sampling_limit_says_the_least():
    """A job record may hold the samples without the run's sampling settings: the tables then say the
    least the samples generate, never nothing."""
    rec = _record("1982-05-05: 19", "1982-05-05: 1982-05-05\n\n")
    rec["sft"].pop("sampling")
    assert "run to 24 tokens or more" in accuracy_examples_html(rec)
    assert "runs to 24 tokens or more" in samples_table_html(rec["sft"]["samples"])


def test_an_answer_cut_short_of_its_sample_is_marked_cut():
    rec = _record("1982-05-05: 19", "1982-05-05: 1982-05-05\n\n")
    cells = _cells(accuracy_examples_html(rec))
    # rows: (before, after) for PROMPT, then for OTHER (no sample: never marked)
    assert [flag for flag, _ in cells] == ["1", "0", "0", "0"], cells
    before = cells[0][1]
    assert before.endswith("…") and "<code>1982-05-05: 19</code>" in before


def test_an_answer_the_sample_only_pads_is_not_marked():
    """The same answer, the sample only running on into whitespace: not cut."""
    rec = _record("1982-05-05", "1982-05-05\n\n", after_got="05/05/1982", sample_after="05/05/1982\n")
    assert [flag for flag, _ in _cells(accuracy_examples_html(rec))] == ["0", "0", "0", "0"]


def test_an_answer_that_differs_from_its_sample_is_not_called_cut():
    rec = _record("1982", "05/05/1982")
    assert _cells(accuracy_examples_html(rec))[0][0] == "0"


def test_no_samples_no_claim_about_them():
    rec = _record("1982-05-05: 19", "")
    rec["sft"]["samples"], rec["sft"]["sampling"] = [], None
    html = accuracy_examples_html(rec)
    assert "the expected answer&#x27;s length + 4 tokens" in html and "samples below" not in html
    assert "…" not in html
