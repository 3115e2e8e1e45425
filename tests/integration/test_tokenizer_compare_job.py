"""The Jobs tab's "Tokenize prompt" comparison with a real Unigram tokenizer job (through a real Valkey
and a real worker) and the default model's tokenizer: unknown tokens marked and counted, round trips
stated per tokenizer."""

from __future__ import annotations

import pytest

BURMESE = "မင်္ဂလာပါ ကျွန်တော်"
ENGLISH = "The tokenizer splits each word into pieces, and decoding joins them again."


@pytest.mark.integration
def test_jobs_tab_compare_with_a_real_unigram_job(tmp_path):
    """What the Jobs tab's "Tokenize prompt" button returns for a Unigram job and the default model."""
    from app.tabs.jobs import tab as jobs_tab
    from tasks import jobs
    from tests.helpers.services import LiveServices

    svc = LiveServices(tmp_path / "data").start()
    try:
        rec = jobs.submit("tokenizer", {"algorithm": "unigram", "vocab_size": 2000, "corpus_max_mb": 0.3},
                          owner="t-unk")
        done = jobs.wait_job(rec["id"], timeout=120, poll=0.1)
        assert done["state"] == "succeeded", (done, svc.worker_log())
        rep = jobs.read_report(done)
        assert "unk_rate" in rep["compression"]
        h, _ = jobs_tab.compare(BURMESE, [], rec["id"])
        assert h.count("class='lmscope-token-stats'") == 2
        assert "smollm2-135m-instruct (default model)</b> · 54 tokens" in h
        assert "data-tokens='54' data-unknown='0' data-roundtrip='true'" in h
        assert "data-tokens='4' data-unknown='2' data-roundtrip='false'" in h
        assert h.count("data-unk='1'") == 2
        h, _ = jobs_tab.compare(ENGLISH, [], rec["id"])
        assert "data-unk='1'" not in h and h.count("data-roundtrip='true'") == 2
    finally:
        svc.stop()
