"""Writes tests/data/decoding_reference.json: diverse (group) beam search and contrastive search on the
real default model, run by transformers' OWN implementations.

transformers 5 moved both methods out of the library to Hub repositories
(transformers-community/group-beam-search, transformers-community/contrastive-search) that load only with
trust_remote_code and a network; lmscope runs neither. transformers 4.55.4 is the last release with both in
core `generate` (`_group_beam_search` with BeamSearchScorer + HammingDiversityLogitsProcessor,
`_contrastive_search` with `_ranking_fast`). This script runs them offline from the model's converted
safetensors folder, so tests/reference/test_decoding.py can compare lmscope's hand implementation
(model_core/serving/search_decoding.py) with a reference nobody here wrote.

Two steps, because the reference needs an older transformers than lmscope's:

    # 1. the cases with their prompt ids (lmscope's tokenizer, transformers 5.x)
    .venv/bin/python tests/data/make_decoding_reference.py spec > /tmp/spec.json
    # 2. transformers 4.55.4 (and the tokenizers / hub client it pins) in a side folder, run on the spec
    .venv/bin/pip install --no-deps --target /tmp/tf455 transformers==4.55.4 tokenizers==0.21.4 huggingface-hub==0.34.4
    PYTHONPATH=/tmp/tf455 .venv/bin/python tests/data/make_decoding_reference.py run /tmp/spec.json \\
        > tests/data/decoding_reference.json
"""

from __future__ import annotations

import json
import os
import sys

CASES = [
    # name, prompt, chat, settings
    ("group-plain", "The best thing about living in the city is", False,
     {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 1.0, "max_new_tokens": 12, "length_penalty": 1.0}),
    ("group-chat", "What is the capital of France? Answer in one word.", True,
     {"num_beams": 4, "num_beam_groups": 2, "diversity_penalty": 0.5, "max_new_tokens": 10, "length_penalty": 1.0}),
    ("group-chat-lp", "What is the capital of France? Answer in one word.", True,
     {"num_beams": 6, "num_beam_groups": 3, "diversity_penalty": 2.0, "max_new_tokens": 8, "length_penalty": 0.5}),
    ("contrastive-plain", "The best thing about living in the city is", False,
     {"penalty_alpha": 0.6, "top_k": 4, "max_new_tokens": 16}),
    ("contrastive-chat", "What is the capital of France? Answer in one word.", True,
     {"penalty_alpha": 0.6, "top_k": 5, "max_new_tokens": 12}),
]


def spec() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from model_core.core.registry import DEFAULT_MODEL, converted_dir, load_model
    from model_core.interp.trace import encode_prompt

    lm = load_model(DEFAULT_MODEL, device="cpu")
    out = {"model": DEFAULT_MODEL, "model_dir": str(converted_dir(DEFAULT_MODEL)), "cases": []}
    for name, prompt, chat, settings in CASES:
        out["cases"].append({"name": name, "prompt": prompt, "chat": chat, "settings": settings,
                             "prompt_ids": encode_prompt(lm, prompt, chat=chat)})
    json.dump(out, sys.stdout, indent=1)


def run(spec_path: str) -> None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    assert transformers.__version__ == "4.55.4", transformers.__version__
    torch.manual_seed(0)
    sp = json.load(open(spec_path))
    # transformers 5 writes the RoPE base as rope_parameters.rope_theta; 4.55 reads rope_theta (else 10,000)
    raw = json.load(open(os.path.join(sp["model_dir"], "config.json")))
    config = AutoConfig.from_pretrained(sp["model_dir"])
    config.rope_theta = raw.get("rope_parameters", {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    model = AutoModelForCausalLM.from_pretrained(sp["model_dir"], config=config, torch_dtype=torch.float32).eval()
    out = {"model": sp["model"], "reference": f"transformers {transformers.__version__} core generate, CPU fp32, "
           f"torch {torch.__version__}", "cases": []}
    for case in sp["cases"]:
        s = dict(case["settings"])
        ids = torch.tensor([case["prompt_ids"]])
        kw = dict(max_new_tokens=s["max_new_tokens"], do_sample=False, output_scores=True,
                  return_dict_in_generate=True, attention_mask=torch.ones_like(ids))
        if "num_beam_groups" in s:
            kw.update(num_beams=s["num_beams"], num_beam_groups=s["num_beam_groups"],
                      diversity_penalty=s["diversity_penalty"], length_penalty=s["length_penalty"],
                      num_return_sequences=s["num_beams"], early_stopping=False)
        else:
            kw.update(penalty_alpha=s["penalty_alpha"], top_k=s["top_k"])
        with torch.no_grad():
            g = model.generate(ids, **kw)
        P = ids.shape[1]
        with torch.no_grad():  # the same model as lmscope's? its next-token log-probs after the prompt
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        top = torch.topk(lp, 10)
        res = {**case, "sequences": [row[P:].tolist() for row in g.sequences],
               "prompt_top_ids": top.indices.tolist(), "prompt_top_logprobs": top.values.tolist()}
        if "num_beam_groups" in s:
            res["sequences_scores"] = g.sequences_scores.tolist()
            res["beam_indices"] = g.beam_indices.tolist()
        else:
            # the processed distribution's top-k at each step (what contrastive search re-ranks)
            res["step_top_ids"] = [torch.topk(torch.softmax(x[0], -1), s["top_k"]).indices.tolist() for x in g.scores]
        out["cases"].append(res)
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "spec":
        spec()
    else:
        run(sys.argv[2])
