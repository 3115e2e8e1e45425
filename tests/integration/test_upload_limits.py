"""Every reader of an uploaded file refuses a 15 MB single-line upload and hostile nesting with one
sentence naming the line, fast and without building the line's objects (issue 37, items 13 and 14).
Before model_core/core/uploads.py the SFT reader parsed the line and the loss-mask preview tokenized
it (minutes, 8-15 GB); nesting answered "(RecursionError)". Limits checked against the README's
"16 characters per token" rule at the default LMSCOPE_MAX_PROMPT_TOKENS (1,024)."""

from __future__ import annotations

import json
import resource
import time

import pytest

from model_core.core import uploads
from model_core.training import preference_data, sft_data
from tasks import corpus

READERS = [sft_data.load_jsonl, preference_data.load_preference_jsonl,
           lambda p: preference_data.load_task_jsonl(p, "exact"), corpus.check_upload]


@pytest.fixture
def files(tmp_path):
    out = {"line": tmp_path / "line.jsonl", "nest": tmp_path / "nest.jsonl", "field": tmp_path / "field.jsonl",
           "txt": tmp_path / "line.txt"}
    out["line"].write_text(json.dumps({"prompt": "a" * 15_000_000, "completion": "b"}) + "\n")
    out["nest"].write_text("[" * 60_000 + "\n")
    out["field"].write_text(json.dumps({"prompt": "a" * 20_000, "completion": "b", "text": "a" * 20_000}) + "\n")
    out["txt"].write_text("a" * 15_000_000 + "\n")
    return out


@pytest.mark.parametrize("reader", READERS)
def test_every_reader_refuses_long_lines_deep_nesting_and_long_texts(reader, files):
    lim = uploads.limits()
    assert (lim.text_chars, lim.line_chars) == (1024 * 16, 4 * 1024 * 16)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for key, words in [("line", "line 1 is 15,000,033 characters long"), ("nest", "nested more than 32 levels"),
                       ("field", "a text of 20,000 characters")]:
        t = time.perf_counter()
        with pytest.raises(Exception) as e:
            reader(files[key])
        msg = str(e.value)
        assert words in msg.replace("Line 1", "line 1"), (key, msg)
        assert "\n" not in msg and "Error" not in msg, msg
        assert time.perf_counter() - t < 2.0
    # the file's text and its lines, not its parse tree: well under 200 MB above where it started
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024 < 200


def test_txt_corpus_line_cap(files):
    with pytest.raises(corpus.CorpusError, match="line 1 is 15,000,000 characters long"):
        corpus.check_upload(files["txt"])
