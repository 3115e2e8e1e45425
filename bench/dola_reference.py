"""Writes tests/data/dola_transformers4.json: DoLa greedy decoding on the real default model, run by
transformers' OWN implementation, for tests/reference/test_dola.py to hold lmscope's
model_core/interp/dola.py to.

transformers 4.56 moved DoLa out of the library (generate then loads `transformers-community/dola`
from the Hub, which needs trust_remote_code and a network; transformers 5 kept it there). 4.55.4 is
the last release with `GenerationMixin._dola_decoding` and `_dola_select_contrast` in core
`generate`. This script runs it offline on the model's converted safetensors folder. transformers 4
does not return the premature layer it picked; the script reads it off the call into
`_relative_top_filter` (which of the candidate logit tensors `_dola_select_contrast` handed it), so
the layers recorded are 4.55.4's own choice, not a recomputation.

Two steps, because the reference needs an older transformers than lmscope's:

    # 1. the cases with their prompt ids (lmscope's tokenizer, transformers 5.x)
    .venv/bin/python bench/dola_reference.py spec > /tmp/dola_spec.json
    # 2. transformers 4.55.4 (and the tokenizers / hub client it pins) in a side folder, run on the spec
    .venv/bin/pip install --no-deps --target /tmp/tf4 transformers==4.55.4 tokenizers==0.21.4 \\
        "huggingface-hub>=0.34,<1"
    PYTHONPATH=/tmp/tf4 .venv/bin/python bench/dola_reference.py run /tmp/dola_spec.json \\
        > tests/data/dola_transformers4.json
"""

from __future__ import annotations

import json
import os
import sys

MAX_NEW_TOKENS = 16
PROMPTS = [
    # name, prompt, chat
    ("france", "The capital of France is", False),
    ("city", "The best thing about living in the city is", False),
    ("chat-water", "At what temperature does water boil at sea level?", True),
]
LAYERS = ("low", "high")


def spec() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from model_core.core.prompts import encode_prompt
    from model_core.core.registry import DEFAULT_MODEL, converted_dir, load_model

    lm = load_model(DEFAULT_MODEL, device="cpu")
    out = {"model": DEFAULT_MODEL, "model_dir": str(converted_dir(DEFAULT_MODEL)), "cases": []}
    for name, prompt, chat in PROMPTS:
        ids = encode_prompt(lm, prompt, chat=chat)
        for layers in LAYERS:
            out["cases"].append({"name": f"{name}-{layers}", "prompt": prompt, "chat": chat, "dola_layers": layers,
                                 "max_new_tokens": MAX_NEW_TOKENS, "prompt_ids": ids})
    json.dump(out, sys.stdout, indent=1)


def run(spec_path: str) -> None:
    import torch
    import transformers
    import transformers.generation.utils as gen_utils
    from transformers import AutoConfig, AutoModelForCausalLM

    assert transformers.__version__.startswith("4."), transformers.__version__
    assert hasattr(gen_utils, "_dola_select_contrast"), "this transformers has no DoLa in core generate (4.56+)"
    sp = json.load(open(spec_path))
    # transformers 5 writes the RoPE base as rope_parameters.rope_theta; 4.x reads rope_theta (else 10,000)
    raw = json.load(open(os.path.join(sp["model_dir"], "config.json")))
    config = AutoConfig.from_pretrained(sp["model_dir"])
    config.rope_theta = raw.get("rope_parameters", {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    model = AutoModelForCausalLM.from_pretrained(sp["model_dir"], config=config, torch_dtype=torch.float32).eval()

    # which candidate tensor _dola_select_contrast passes on to _relative_top_filter = the layer it picked
    seen: dict = {}
    picked: list[int] = []
    select, relative_top = gen_utils._dola_select_contrast, gen_utils._relative_top_filter

    def select_spy(layers, logits_by_layer, final_logits):
        seen["logits"] = logits_by_layer
        seen["candidates"] = list(layers)
        return select(layers, logits_by_layer, final_logits)

    def filter_spy(scores, baseline_scores, *a, **k):
        picked.append(next(i for i, t in seen["logits"].items() if t is baseline_scores))
        return relative_top(scores, baseline_scores, *a, **k)

    gen_utils._dola_select_contrast, gen_utils._relative_top_filter = select_spy, filter_spy
    out = {"model": sp["model"], "transformers": transformers.__version__, "torch": torch.__version__,
           "reference": f"transformers {transformers.__version__} core generate (_dola_decoding), CPU fp32, "
                        f"greedy, repetition_penalty 1.0", "script": "bench/dola_reference.py", "cases": []}
    for case in sp["cases"]:
        ids = torch.tensor([case["prompt_ids"]])
        picked.clear()
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), dola_layers=case["dola_layers"],
                               do_sample=False, max_new_tokens=case["max_new_tokens"], repetition_penalty=1.0,
                               output_scores=True, return_dict_in_generate=True)
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)  # the same model as lmscope's?
        top = torch.topk(lp, 10)
        P = ids.shape[1]
        steps = []
        for layer, s in zip(picked, g.scores):
            t = torch.topk(s[0], 5)
            steps.append({"premature_layer": layer, "top_ids": t.indices.tolist(), "top_scores": t.values.tolist()})
        out["cases"].append({**case, "candidates": seen["candidates"], "token_ids": g.sequences[0, P:].tolist(),
                             "steps": steps, "prompt_top_ids": top.indices.tolist(),
                             "prompt_top_logprobs": top.values.tolist()})
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "spec":
        spec()
    else:
        run(sys.argv[2])
