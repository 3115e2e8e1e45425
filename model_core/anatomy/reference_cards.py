"""Architecture cards computed from a configuration alone: six reference systems that nobody here
has weights for (Llama 3.2-1B, GPT-2, GPT-3 175B, Mistral 7B, DeepSeek-V2, Granite 3B), and any
loaded or local model.

Each reference is its published configuration (config.json values, or a paper's numbers) given to
transformers' own config class; the model is built on PyTorch's `meta` device (shapes, no memory)
and every card field is computed from that model: parameters by summing its tensors (each tensor
once, so tied weights once), key/value-cache bytes from the widths of the projections that produce
what is cached, norm placement by watching which tensors layer 0's norms read and write in a meta
forward. Nothing on a card is typed in; the sources' own claims (`Claim`) are kept beside the cards
and compared with what was computed, each difference with its reason.

The decoder guide's comparison table (the text lmscope is built from) is not on disk; its claims
are encoded as issue 21 quotes them (the table errors it names) and labelled "table (as quoted in
issue 21)". Published numbers come with their source (paper, model card, config.json). The
references themselves (configs, claims, caveats) are data: reference_cards.json beside this file.

Pure PyTorch + transformers; no gradio.

This module holds the references, the claims compared with the computed values and the entry
points (`card`, `reference_card`, `loaded_card`); the card's fields are computed in
decoder_card.py and shown as rows by card_rows.py, both importable from here too.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from model_core.anatomy.card_rows import (
    CLAIM_ROWS,
    FORMULAS,
    display_rows,
    kv_growth,
    param_shares,
    row_marks,
)
from model_core.anatomy.decoder_card import (
    ATTN_NAMES,
    FP16,
    MLP_NAMES,
    PARTS,
    card_from_model,
    find_layers,
    kv_bytes_at,
    meta_model,
    norm_wiring,
    param_parts,
)
from model_core.core.errors import ModelLoadError

__all__ = [
    "ALIASES", "ATTN_NAMES", "CLAIM_ROWS", "FORMULAS", "FP16", "MLP_NAMES", "PARTS", "REFERENCES",
    "Claim", "Reference",
    "card", "card_from_model", "claim_matches", "comparison", "config_card", "display_rows", "find_layers",
    "kv_bytes_at", "kv_growth", "loaded_card", "meta_model", "norm_wiring", "param_parts", "param_shares",
    "reference", "reference_card", "reference_config", "reference_names", "row_marks", "to_json",
]


# ---------------------------------------------------------------------------------------------
# The references: published configuration + what the sources claim


@dataclass(frozen=True)
class Claim:
    """One thing a source states about a model, for comparison with the computed card.
    `value`: as stated ('124M', 'post-norm', 2048, ...); None when a source is reported wrong
    but its value was not quoted. `note`: why the computed value differs (shown when it does)."""
    field: str
    value: object
    source: str
    note: str = ""


@dataclass(frozen=True)
class Reference:
    name: str
    title: str
    config_class: str
    config: dict
    source: str
    claims: tuple = ()
    notes: tuple = ()  # caveats about the configuration itself (values not confirmed by a source)


def _load_references(path: Path) -> OrderedDict[str, Reference]:
    """The references as published: reference_cards.json (each one's config.json values or a paper's
    numbers, its sources' claims and caveats), one Reference per entry, in the file's order."""
    refs = OrderedDict()
    for r in json.loads(path.read_text(encoding="utf-8"))["references"]:
        refs[r["name"]] = Reference(name=r["name"], title=r["title"], config_class=r["config_class"],
                                    config=r["config"], source=r["source"],
                                    claims=tuple(Claim(**c) for c in r["claims"]), notes=tuple(r.get("notes", ())))
    return refs


REFERENCES: OrderedDict[str, Reference] = _load_references(Path(__file__).with_name("reference_cards.json"))

ALIASES = {"gpt2-small (config only)": "gpt2", "gpt-2": "gpt2", "gpt3": "gpt3-175b", "mistral": "mistral-7b",
           "llama-3.2-1B": "llama-3.2-1b", "deepseek-v2-236b": "deepseek-v2", "granite": "granite-3b"}


def reference_names() -> list[str]:
    return list(REFERENCES)


def reference(name: str) -> Reference:
    key = ALIASES.get(name, name)
    if key not in REFERENCES:
        raise ModelLoadError(f"Unknown reference card '{name}': use one of {', '.join(REFERENCES)}.")
    return REFERENCES[key]


def reference_config(name: str):
    """The reference's published values given to transformers' own config class."""
    import transformers

    ref = reference(name)
    return getattr(transformers, ref.config_class)(**ref.config)


# ---------------------------------------------------------------------------------------------
# Claims vs computed values


_UNITS = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def _parse_amount(text: str, binary: bool = False) -> tuple[float, float] | None:
    """'124M' -> (124e6, 1e6): the value and the size of its last stated digit."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMBT])\s*", str(text))
    if not m:
        return None
    num, unit = m.group(1), m.group(2)
    scale = 1024 if (binary and unit == "K") else _UNITS[unit]
    decimals = len(num.split(".")[1]) if "." in num else 0
    return float(num) * scale, scale * 10 ** -decimals


def claim_matches(claim: Claim, computed) -> bool | None:
    """Does the source's statement agree with the computed value? Rounded amounts ('7B', '128K')
    agree when the computed value rounds or truncates to them at the precision stated; None when
    the source's value was not quoted."""
    v = claim.value
    if v is None:
        return False
    if isinstance(v, str) and isinstance(computed, (int, float)) and not isinstance(computed, bool):
        amt = _parse_amount(v, binary=claim.field == "max_context")
        if amt is not None:
            value, step = amt
            return abs(computed - value) <= step / 2 + 1e-9 or 0 <= computed - value < step
    if claim.field == "attention" and isinstance(computed, str):
        return str(v).lower() in computed.lower()
    if claim.field == "norm_position":
        return str(v).lower() == str(computed).lower()
    return v == computed


def comparison(card: dict, ref: Reference) -> list[dict]:
    """Each source claim next to the computed value: {field, computed, claim, source, agrees, note}."""
    out = []
    for cl in ref.claims:
        computed = card.get(cl.field)
        ok = claim_matches(cl, computed)
        out.append({"field": cl.field, "computed": computed, "claim": cl.value, "source": cl.source,
                    "agrees": ok, "note": "" if ok else (cl.note or "The computed value differs from the source.")})
    return out


# ---------------------------------------------------------------------------------------------
# Entry points


@cache
def _reference_card(name: str) -> dict:
    ref = reference(name)
    t0 = time.perf_counter()
    model = meta_model(reference_config(ref.name))
    card = card_from_model(model, name=ref.name, weights="none: the published configuration, built on the meta device",
                           source=ref.source)
    card["title"] = ref.title
    card["config_class"] = ref.config_class
    card["comparison"] = comparison(card, ref)
    card["notes"] = list(ref.notes)
    card["seconds"] = round(time.perf_counter() - t0, 3)  # build on meta + every computation
    return card


def reference_card(name: str) -> dict:
    """A reference system's card (cached: a copy per call)."""
    return _copy(_reference_card(reference(name).name))


def _copy(card: dict) -> dict:
    import copy

    return copy.deepcopy(card)


def loaded_card(lm) -> dict:
    """The card of a LoadedModel (its real tensors)."""
    weights = ("random (untrained, seed 0): numbers about shapes only" if lm.source == "random"
               else f"loaded ({lm.source}, {str(lm.dtype).replace('torch.', '')})")
    card = card_from_model(lm.model, name=lm.name, weights=weights, source=f"lmscope model '{lm.name}'")
    card["title"] = lm.name + (" (random weights)" if lm.source == "random" else "")
    return card


def config_card(config, name: str, weights: str, source: str) -> dict:
    card = card_from_model(meta_model(config), name=name, weights=weights, source=source)
    card["title"] = name
    return card


def card(name: str) -> dict:
    """`lmscope card NAME`: a reference, or any model lmscope knows, from its config when one is on
    disk (no weights read), else by loading it."""
    if ALIASES.get(name, name) in REFERENCES:
        return reference_card(name)
    from transformers import AutoConfig

    from model_core.core.registry import (
        RANDOM_CONFIGS,
        REGISTRY,
        converted_dir,
        finetuned_path,
        is_ready,
        load_model,
    )

    entry = REGISTRY.get(name)
    if entry is not None and entry.source == "random":
        cfg = dict(RANDOM_CONFIGS[name])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        out = config_card(config, name, "random (untrained, seed 0): numbers about shapes only",
                          f"lmscope random-weight test config '{name}'")
        out["title"] = f"{name} (random weights)"
        return out
    folder = None
    if entry is not None and is_ready(name):
        folder = converted_dir(name)
    elif entry is None:
        folder = finetuned_path(name) or (Path(name).expanduser() if Path(name).expanduser().is_dir() else None)
    if folder is not None and (Path(folder) / "config.json").exists():
        try:
            config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"Could not read the config of '{name}': {str(e).splitlines()[0]}") from e
        return config_card(config, name, f"none read: {Path(folder).name}/config.json built on the meta device",
                           f"config.json in {folder}")
    return loaded_card(load_model(name))


def to_json(card: dict) -> dict:
    """The card without private fields, JSON-ready."""
    return {k: v for k, v in card.items() if not k.startswith("_")}
