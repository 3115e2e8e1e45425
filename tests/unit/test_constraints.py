"""`make setup` installs the versions the suite last passed with (constraints.txt), not the newest releases
pyproject.toml's ranges admit: a fresh machine took transformers 5.25, whose new model types were missing
from docs/ARCHITECTURES.md (generated against 5.24), and tests/reference/test_architecture_coverage.py failed."""

import re
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, ver = line.partition("==")
            assert name and re.fullmatch(r"[\w.+-]+", ver), f"not name==version: {line!r}"
            pins[name.lower().replace("_", "-")] = ver
    return pins


def test_setup_and_the_image_install_the_pinned_versions():
    pins = _pins()
    assert {"transformers", "gradio", "torch", "plotly", "celery"} <= set(pins)
    makefile = (ROOT / "Makefile").read_text()
    assert "-e '.[dev]' -c constraints.txt" in makefile
    assert "constraints.txt" in re.search(r"\$\(STAMP\):.*", makefile).group()  # a changed pin reinstalls
    assert "pip install -e . -c /tmp/constraints.txt" in (ROOT / "Dockerfile").read_text()
    # pyproject's own exact pins agree with the file
    for name, ver in re.findall(r'"([\w-]+)==([\w.]+)"', (ROOT / "pyproject.toml").read_text()):
        assert pins.get(name.lower()) == ver, (name, ver, pins.get(name.lower()))


def test_the_architecture_table_is_for_the_pinned_transformers():
    pinned = _pins()["transformers"]
    table = re.search(r"against transformers ([\d.]+)", (ROOT / "docs" / "ARCHITECTURES.md").read_text()).group(1)
    assert table == pinned, f"docs/ARCHITECTURES.md is for transformers {table}, constraints.txt pins {pinned}"
    assert version("transformers") == pinned, "this environment was not set up by `make setup`"
