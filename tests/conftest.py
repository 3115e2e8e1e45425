import os

import pytest
import torch

# Tests run on the CPU in fp32 whatever the machine has, so references compare exactly.
os.environ.setdefault("LMSCOPE_DEVICE", "cpu")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

DEFAULT = "smollm2-135m-instruct"
RANDOM_MODELS = ["random-gpt2-tiny", "random-gemma3-tiny", "random-llama-tiny"]


@pytest.fixture(scope="session")
def default_lm():
    from model_core import load_model

    return load_model(DEFAULT)


@pytest.fixture(scope="session")
def default_lm_eager():
    from model_core import load_model

    return load_model(DEFAULT, attn_implementation="eager")


@pytest.fixture(scope="session")
def server():
    """One `lmscope serve` (default settings, no job services) for every browser test module;
    modules that need other settings (sign-in, fuzzing) define their own `server`."""
    from tests.helpers.browser import LiveServer

    s = LiveServer()
    yield s
    s.stop()


def pytest_collection_modifyitems(config, items):
    """A test under tests/integration or tests/browser carries that tier's mark (so `-m "not
    integration and not browser"` leaves out every test that needs services or Chromium)."""
    for item in items:
        tier = item.path.parent.name
        if tier in ("integration", "browser"):
            item.add_marker(getattr(pytest.mark, tier))
