"""The coverage table docs/ARCHITECTURES.md is what this test runs: the whole walk over
transformers' causal-LM types (bench/architectures.py's run_many: long-lived worker processes, one
per core, each restarted after a crash), every decoder-only type's tiny random model checked
against transformers itself (eager attentions, output_hidden_states, logits, model.generate).

Reference: transformers' own outputs for the same weights, compared inside bench/architectures.py's
check_one; this test asserts that every type the table marks pass still passes and that the
table's pass count is the run's (regenerate with
`.venv/bin/python bench/architectures.py --write docs/ARCHITECTURES.md`)."""

import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_architectures", _ROOT / "bench" / "architectures.py")
architectures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architectures)

DOC = _ROOT / "docs" / "ARCHITECTURES.md"


def test_every_type_marked_pass_still_passes_and_the_table_counts_the_run():
    documented = architectures.read_table(DOC)
    types = architectures.all_types()
    assert sorted(documented) == sorted(types), "the table lists other types than transformers ships: regenerate it"
    rows = {r["type"]: r for r in architectures.run_many(types)}
    regressed = {t: rows[t].get("reason") for t, s in documented.items() if s == "pass" and rows[t]["status"] != "pass"}
    assert not regressed, f"marked pass in {DOC.name} but failing now: {regressed}"
    ran = sum(r["status"] == "pass" for r in rows.values())
    doc = sum(s == "pass" for s in documented.values())
    assert ran == doc, (f"{ran} types pass now, the table says {doc}: regenerate {DOC.name} "
                        f"(newly passing: {sorted(t for t, r in rows.items() if r['status'] == 'pass' and documented[t] != 'pass')})")
    assert {t for t, s in documented.items() if s == "not applicable"} == {
        t for t, r in rows.items() if r["status"] == "not applicable"}
