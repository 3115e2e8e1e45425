"""Greedy generation through lmscope equals transformers' own `generate` (the reference) for the
families whose cache the engine's slot cache does not hold, and for one whose head is more than
the adapter's unembedding.

Each family is a tiny random model (bench/architectures.py's tiny sizes, with the layer kinds a
family needs), saved and opened by path. lmscope's `generate` runs on the engine where
`engine_fit` says the slot cache fits the model, else on transformers' DynamicCache
(model_core.serving.request_forwards); either way its greedy tokens must equal
`model.generate(do_sample=False)` of the same weights loaded by transformers alone, token for
token (EOS neither ends nor is suppressed on either side: lmscope's `ignore_eos`, transformers'
generation config without an EOS id).

- modernbert-decoder: its head (dense, activation, norm, decoder) is more than the adapter's
  unembedding: the engine prefills with the model's own forward (it generated one token ahead).
- deepseek_v3 (multi-head latent attention: keys and values of different head sizes), qwen3_next
  (linear attention), lfm2_moe (convolution layers), hrm_text (its layers run several times per
  token), gemma3n_text with shared key/value layers: transformers' cache, with the same records.
"""

import importlib.util
import inspect
import logging
from pathlib import Path

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from model_core import load_model
from model_core.core.tokenization import byte_tokenizer
from model_core.serving import engine
from model_core.serving.engine_fit import engine_fit
from model_core.serving.generate import generate, generation_to_json

_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "architectures.py"
_spec = importlib.util.spec_from_file_location("bench_architectures_gen", _SCRIPT)
architectures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architectures)

PROMPT = "The cat sat on a mat."
NEW_TOKENS = 8

# (test id, model type, config fields beyond the bench's tiny sizes): the layer kinds each family
# needs (the bench's tiny config names none, and these families need at least one attention layer
# or one kind of each), and Gemma 3n's last two of four layers reading the first two's keys/values.
FAMILIES = {
    "modernbert-decoder": ("modernbert-decoder", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen3_next": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"])),
    "lfm2_moe": ("lfm2_moe", dict(layer_types=["conv", "full_attention"])),
    "hrm_text": ("hrm_text", {}),
    "gemma3n_shared_kv": ("gemma3n_text", dict(num_hidden_layers=4, num_kv_shared_layers=2,
                                               layer_types=["sliding_attention", "full_attention"] * 2)),
}
ON_ENGINE = {"modernbert-decoder"}
# what engine_fit's reason names for each family that falls back
REASONS = {"deepseek_v3": "latent attention", "qwen3_next": "linear_attention", "lfm2_moe": "conv",
           "hrm_text": "run more than once", "gemma3n_shared_kv": "shared key/value"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny_config(model_type: str, extra: dict):
    cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    fields = {**architectures.TINY, **architectures.FIXES.get(model_type, {}), **extra}
    if not extra:
        return architectures.tiny_config(model_type)
    return cls(**{k: v for k, v in fields.items() if k in params})


def _saved(tmp_path, key: str) -> Path:
    model_type, extra = FAMILIES.get(key, (key, {}))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_tiny_config(model_type, extra), dtype=torch.float32).save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    return tmp_path


def _transformers_greedy(folder: Path, ids: list[int]) -> list[int]:
    """The reference: transformers alone (its own attention and cache), greedy, never stopping at EOS."""
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = ref.generation_config
    config.eos_token_id = None
    with torch.inference_mode():
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           generation_config=config, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=257)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("key", list(FAMILIES))
def test_greedy_generation_equals_transformers_generate(key, tmp_path, caplog):
    folder = _saved(tmp_path, key)
    lm = load_model(str(folder), device="cpu", dtype="float32", allow_hub=False)
    with caplog.at_level(logging.INFO, logger="model_core.serving.engine_fit"):
        on_engine = engine.can_use_engine(lm, enabled=True)
        engine.can_use_engine(lm, enabled=True)  # decided once per model
    assert on_engine == (key in ON_ENGINE), engine_fit(lm)
    fallback_logs = [r for r in caplog.records if "transformers' own cache" in r.getMessage()]
    if key in ON_ENGINE:
        assert not fallback_logs
    else:
        assert len(fallback_logs) == 1 and REASONS[key] in fallback_logs[0].getMessage(), fallback_logs

    ids = lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    g = generate(lm, lm.tokenizer.decode(ids), max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert g.prompt_ids == ids
    assert g.token_ids == _transformers_greedy(folder, ids)
    if on_engine:
        assert engine.existing_engine(lm) is not None  # it did run there
    # the same per-step records either way: every step with its candidates, chosen rank and probability
    steps = generation_to_json(lm, g)["steps"]
    assert [s["chosen"]["id"] for s in steps] == g.token_ids
    assert all(len(s["top_before"]) == 10 and s["top_before"][0]["id"] == s["chosen"]["id"] for s in steps)


def test_a_head_beyond_the_unembedding_prefills_with_the_models_forward(tmp_path):
    """ModernBERT-decoder's logits are its prediction head's, not the adapter's unembedding of the
    decoder's last hidden state: the engine fits, but its prefills run the model's own forward."""
    lm = load_model(str(_saved(tmp_path, "modernbert-decoder")), device="cpu", dtype="float32", allow_hub=False)
    fit = engine_fit(lm)
    assert fit.fits and not fit.hidden_prefill, fit


def test_a_step_that_cannot_be_captured_runs_eagerly_on_the_engine(tmp_path, caplog):
    """Mixture-of-experts routing that reads values back to the host cannot be captured as a CUDA
    graph (Mixtral, Qwen2-MoE, OLMoE, GPT-OSS on an H200): the engine then runs eager steps instead
    of sending every request down the one-at-a-time path. On a CPU any capture fails, which
    exercises the same fallback; greedy stays equal to transformers' generate (the reference)."""
    folder = _saved(tmp_path, "qwen2_moe")
    lm = load_model(str(folder), device="cpu", dtype="float32", allow_hub=False)
    with caplog.at_level(logging.WARNING, logger="model_core.serving.engine"):
        eng = engine.Engine(lm, slots=2, max_len=64, use_graphs=True, compile=False)
        eng.ready.wait(60)
    lm.meta["engine"] = eng  # the model's engine, as engine_for would have made it
    try:
        assert eng.start_error is None and not eng.use_graphs and eng.steps_per_launch == 1
        assert any("eager steps" in r.getMessage() for r in caplog.records)
        ids = lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        g = generate(lm, lm.tokenizer.decode(ids), max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert g.token_ids == _transformers_greedy(folder, ids)
        assert sum(eng.stats.batch_sizes.values()) == NEW_TOKENS - 1  # every step after the prefill's on it
    finally:
        eng.close()
