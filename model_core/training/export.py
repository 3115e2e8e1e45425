"""Take a fine-tuned model away: a Hugging Face model folder in a zip, with a model card.

`model_card(meta)` writes README.md from the run record that SFT saves as lmscope.json (parent,
dataset, settings, held-out accuracy, final losses; see model_core.training.sft.run_sft). `write_model_zip`
packs the files `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` read
(config, safetensors, tokenizer, chat template, generation config) plus that README.md, under one
folder named after the model. lmscope.json itself stays behind: its settings hold server paths
(an uploaded dataset's location), and the card carries what a reader needs.

Pure Python + the standard library; no model is loaded.
"""

from __future__ import annotations

import json
import os
import re
import time
import zipfile
from pathlib import Path
from typing import IO

# The files of a Hugging Face causal-LM folder that loading needs (and nothing else: no optimizer
# state, no run record). Sharded weights: model-00001-of-00002.safetensors + the index.
EXPORT_FILES = (
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model",
    "chat_template.jinja", "chat_template.json",
    "model.safetensors.index.json",
)
_WEIGHTS_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")

# Registry names whose weights came from a public Hub model (for the card's `base_model`). The
# registry's copies are dequantised from a GGUF, so they are close to, not equal to, these.
HUB_PARENTS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def export_files(model_dir: Path) -> list[Path]:
    """The files of `model_dir` that go into the zip: regular files (no links) named in EXPORT_FILES
    or matching the safetensors weight names."""
    out = []
    for p in sorted(Path(model_dir).iterdir()):
        if p.is_symlink() or not p.is_file():
            continue
        if p.name in EXPORT_FILES or _WEIGHTS_RE.match(p.name):
            out.append(p)
    return out


def _fmt(x, spec: str = ".4f") -> str:
    return "–" if x is None else format(x, spec)


def _count(x) -> str:
    return f"{x:,}" if isinstance(x, int) else "?"


def _acc(a: dict | None) -> str:
    return f"{a['correct']}/{a['n']} ({a['accuracy']:.0%})" if a else "–"


def _hub_parent(parent: str | None) -> str | None:
    if not parent:
        return None
    if parent in HUB_PARENTS:
        return HUB_PARENTS[parent]
    parts = parent.split("/")
    if len(parts) == 2 and all(parts) and not parent.startswith((".", "/", "~")) and ".." not in parent:
        return parent  # a hub id ("org/name")
    return None


def _yaml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML flow scalar


def model_card(meta: dict, name: str | None = None) -> str:
    """README.md (Hugging Face model card: YAML front matter + Markdown) for a fine-tuned model from
    its lmscope.json record. `name` defaults to meta['name'] or the record's output_name. Never
    writes a server path: an uploaded dataset appears by file name only."""
    meta = meta if isinstance(meta, dict) else {}
    tr = meta.get("training") or {}
    ds = meta.get("dataset") or {}
    metrics = meta.get("metrics") or {}
    data = meta.get("data") or {}
    name = name or meta.get("name") or tr.get("output_name") or "model"
    parent = meta.get("parent") or tr.get("model")
    method = tr.get("method", "full")
    hub_parent = _hub_parent(parent)

    front = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", "- lmscope", "- sft"]
    if method == "lora":
        front.append("- lora")
    if hub_parent:
        front += ["base_model:", f"- {_yaml_str(hub_parent)}"]
    front.append("---")

    L = [f"# {name}", ""]
    if parent:
        L.append(f"A {'LoRA (merged)' if method == 'lora' else 'full'} supervised fine-tune of **{parent}**"
                 + (f" (Hub: [{hub_parent}](https://huggingface.co/{hub_parent}))" if hub_parent else "") + ".")
    else:
        L.append("A supervised fine-tune (the parent model was not recorded).")
    if parent in HUB_PARENTS:
        L.append(f"lmscope's `{parent}` is {HUB_PARENTS[parent]} dequantised from a GGUF release, so the "
                 "starting weights are close to, not bit-equal to, the Hub checkpoint.")
    L += ["", "Trained with lmscope.", ""]

    # data
    L += ["## Data", ""]
    if ds.get("source") == "builtin":
        L.append(f"lmscope's built-in task `{ds.get('task', 'date-reformat')}` (rewrite an ISO date as DD/MM/YYYY), "
                 f"{ds.get('size', '?')} generated conversations (seed {tr.get('seed', '?')}).")
    elif ds:
        L.append(f"Uploaded chat JSONL `{Path(str(ds.get('file') or 'dataset.jsonl')).name}`, "
                 f"{ds.get('size', '?')} conversations.")
    else:
        L.append("Not recorded.")
    digest = next((ds[k] for k in ("sha256", "data_hash", "hash") if ds.get(k)), None)
    if digest:
        L.append(f"Data hash: `{digest}`.")
    trd, evd = data.get("train"), data.get("eval")
    if trd:
        L.append(f"{trd.get('examples', '?')} training examples ({_count(trd.get('trained_tokens'))} of "
                 f"{_count(trd.get('tokens'))} tokens in the loss: assistant turns only), "
                 f"{evd.get('examples', 0) if evd else 0} held out for eval loss.")
    L.append("")

    # settings
    steps = metrics.get("steps") or tr.get("max_steps")
    rows = [("method", "LoRA, merged into the weights" if method == "lora" else "full fine-tuning")]
    if method == "lora":
        rows += [("LoRA rank", tr.get("lora_rank")), ("LoRA alpha", tr.get("lora_alpha")),
                 ("LoRA targets", "all linear layers")]
    rows += [("learning rate", tr.get("learning_rate")), ("schedule", "linear decay, "
              f"{tr.get('warmup_steps', 0)} warm-up steps"), ("steps", steps),
             ("batch size", tr.get("batch_size")), ("max length", tr.get("max_length")),
             ("seed", tr.get("seed")), ("optimizer", "AdamW (torch), weight decay 0, grad clip 1.0")]
    L += ["## Training settings", "", "| setting | value |", "|---|---|"]
    L += [f"| {k} | {'–' if v is None else v} |" for k, v in rows]
    L.append("")

    # results
    b, a = meta.get("accuracy_before"), meta.get("accuracy_after")
    L += ["## Results", "", "| metric | value |", "|---|---|"]
    if a or b:
        L.append(f"| held-out accuracy (greedy, exact match) before → after | {_acc(b)} → {_acc(a)} |")
    L += [f"| first train loss | {_fmt(metrics.get('first_loss'))} |",
          f"| final train loss | {_fmt(metrics.get('final_loss'))} |",
          f"| final eval loss | {_fmt(metrics.get('final_eval_loss'))} |"]
    if metrics.get("tokens_seen"):
        L.append(f"| tokens seen | {metrics['tokens_seen']:,} |")
    if metrics.get("train_seconds") is not None:
        L.append(f"| training time | {metrics['train_seconds']:.1f} s |")
    L.append("")
    if meta.get("created"):
        L += [f"Created {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(meta['created']))}.", ""]

    # usage
    example = ("Rewrite the date 2024-03-15 in the format DD/MM/YYYY. Answer with the date only."
               if ds.get("source") == "builtin" else "Hello!")
    L += ["## Use it", "", "Unzip, then:", "", "```python",
          "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
          f'path = "./{name}"  # the unzipped folder',
          "model = AutoModelForCausalLM.from_pretrained(path)",
          "tokenizer = AutoTokenizer.from_pretrained(path)",
          f"messages = [{{\"role\": \"user\", \"content\": {json.dumps(example)}}}]",
          "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\",",
          "                                       return_dict=True)",
          "out = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
          "print(tokenizer.decode(out[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))",
          "```", ""]
    if meta.get("chat_template_added"):
        L += ["The parent had no chat template; lmscope gave it a simple one (`role: content<eos>` per turn), "
              "saved with the tokenizer.", ""]
    L += ["The parent model's license and terms apply to these weights.", ""]
    return "\n".join(front) + "\n\n" + "\n".join(L)


def write_model_zip(model_dir: Path, out: Path | str | IO[bytes], card: str, folder: str | None = None) -> list[str]:
    """Zip a model folder for download: the loading files (see export_files) and `card` as
    README.md, all under `folder/` (default: the model folder's name). Weights are stored (they do
    not compress); text files deflated. `out` is a path or a writable binary file (seekable or not).
    Returns the names written."""
    model_dir = Path(model_dir)
    folder = (folder or model_dir.name).strip("/")
    files = export_files(model_dir)
    if not any(_WEIGHTS_RE.match(p.name) for p in files) or not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"'{model_dir.name}' has no config.json and safetensors weights to export.")
    target = os.fspath(out) if isinstance(out, (str, os.PathLike)) else out
    names = []
    with zipfile.ZipFile(target, "w", allowZip64=True) as z:
        for p in files:
            info = zipfile.ZipInfo.from_file(p, f"{folder}/{p.name}")
            info.external_attr = (0o100644 << 16)  # regular file, rw-r--r-- (safetensors are saved 0600)
            info.compress_type = zipfile.ZIP_STORED if p.suffix == ".safetensors" else zipfile.ZIP_DEFLATED
            with open(p, "rb") as src, z.open(info, "w", force_zip64=info.file_size > 2**31) as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            names.append(info.filename)
        readme = zipfile.ZipInfo(f"{folder}/README.md", time.localtime()[:6])
        readme.external_attr = (0o100644 << 16)
        readme.compress_type = zipfile.ZIP_DEFLATED
        z.writestr(readme, card.encode("utf-8"))
        names.append(readme.filename)
    return names
