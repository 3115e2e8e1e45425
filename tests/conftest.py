import os

import pytest
import torch

# Tests run on the CPU in fp32 whatever the machine has, so references compare exactly.
os.environ.setdefault("LMSCOPE_DEVICE", "cpu")
# Every engine a test starts (and every test server's) would record its first buckets in the
# background: ~20 s of tracing each, beside the tests on the 2 cores of CI. The recorded path has
# tests of its own that turn it on (tests/reference/test_engine.py, test_trace_reference.py), and the
# browser tests' shared server records as `make run`'s does (the `server` fixture below).
os.environ.setdefault("LMSCOPE_RECORD_STEPS", "0")
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
    modules that need other settings (sign-in, fuzzing) define their own `server`. It records its
    CPU engine's calls as `make run`'s server does (this session's default turns that off above)."""
    from tests.helpers.browser import LiveServer

    s = LiveServer(extra_env={"LMSCOPE_RECORD_STEPS": "1"})
    yield s
    s.stop()


@pytest.fixture(scope="session")
def feature_set(default_lm):
    """A small sparse-autoencoder feature set on the real default model (512 tokens of the built-in
    corpus, layer 6 resid_post), trained once per session into the default data folder, where the
    session's `lmscope serve` also finds it; removed at the end."""
    import shutil

    from model_core.interp import features as F

    name = "tests-small-l6"
    shutil.rmtree(F.features_dir() / name, ignore_errors=True)
    F.train_features(default_lm.name, 6, "resid_post", "builtin", name=name, seed=4, max_tokens=512,
                     num_latents=1152, k=16, batch_size=4, context=32, eval_tokens=256, context_tokens=512)
    yield name
    shutil.rmtree(F.features_dir() / name, ignore_errors=True)


@pytest.fixture(scope="session")
def transcoder_set(default_lm):
    """A small transcoder set for every layer of the real default model (2,048 tokens of the built-in
    corpus), trained once per session into the default data folder, where the session's `lmscope
    serve` also finds it; removed at the end."""
    import shutil

    from model_core.interp import transcoders as TC

    name = "tests-small-tc"
    shutil.rmtree(TC.transcoders_dir() / name, ignore_errors=True)
    TC.train_transcoders(default_lm.name, max_tokens=2048, context=64, batch_size=8, k=16, expansion_factor=2,
                         eval_tokens=256, name=name)
    yield name
    shutil.rmtree(TC.transcoders_dir() / name, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """A test under tests/integration or tests/browser carries that tier's mark (so `-m "not
    integration and not browser"` leaves out every test that needs services or Chromium)."""
    for item in items:
        tier = item.path.parent.name
        if tier in ("integration", "browser"):
            item.add_marker(getattr(pytest.mark, tier))


def pytest_runtest_logreport(report):
    """A failure is printed when it happens, not only in the summary at the end: a run stopped for its time
    (CI's limit) still shows why each test before it failed."""
    if report.failed:
        import sys

        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-3000:]}\n")
