"""Which decoder-only architectures lmscope traces, checked against transformers itself.

Walks transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES. Each decoder-only type gets a tiny random
config (hidden 64, 2 layers, 4 heads, vocab 300), saved with lmscope's byte tokenizer and opened
with model_core.load_model in a long-lived worker process (one per core, memory limit, timeout per
type, restarted after a crash). Checked against the
same weights in transformers (eager attention): each layer's input vs output_hidden_states, the
residual decomposition resid_pre + attn_out + mlp_out = next layer's input, each attention
pattern vs output_attentions, the logits, and greedy generation (lmscope's generate vs
model.generate). Encoder, encoder-decoder and multimodal types are listed as not applicable.

    .venv/bin/python bench/architectures.py [--types a,b] [--workers N] [--write docs/ARCHITECTURES.md]
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
MEMORY_BYTES = 6 * 2**30
ATOL = 1e-4
PROMPT = "The cat sat on a mat."  # 21 byte tokens: longer than the 4-token sliding window set below
NEW_TOKENS = 8

# Tiny sizes, set only where a config has the field (its __init__ takes it).
TINY = dict(
    hidden_size=64, n_embd=64, d_model=64, dim=64, num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2,
    num_attention_heads=4, n_head=4, num_heads=4, n_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, n_inner=128, ffn_dim=128, d_ff=128, ffn_hidden_size=128, vocab_size=300,
    max_position_embeddings=512, n_positions=512, max_seq_len=512, seq_length=512,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=32,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16, sliding_window=4,
    first_k_dense_replace=1, n_group=1, topk_group=1, layer_types=None, bos_token_id=256, eos_token_id=257, pad_token_id=257,
)
# Per-family fixes where a generic tiny size is not a valid config of that family.
FIXES: dict[str, dict] = {
    "gpt_neox": dict(use_parallel_residual=True),
    "mixtral": dict(num_local_experts=4),
    "gptj": dict(rotary_dim=8),
    "codegen": dict(rotary_dim=8),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "dots3_note_text": dict(num_key_value_heads=4),
    # Hybrids: one layer of each kind (their defaults put attention past the second layer).
    **{t: dict(layer_types=["linear_attention", "full_attention"]) for t in (
        "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "kimi_linear", "bailing_hybrid", "granitemoehybrid")},
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1]),
    "lfm3": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # Zamba: every hybrid layer holds the one shared transformer block (tied weights; Zamba 2 with its
    # per-layer adapters), so two hybrid layers, as a real checkpoint's dozen: with one, the tie has no
    # layer to reach and loading refuses.
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"],
                   use_shared_attention_adapter=True, adapter_rank=8,
                   num_key_value_heads=4),  # the adapters add full-width keys and values: no GQA
    "zaya": dict(num_experts_per_tok=1),
    "longcat_flash": dict(head_dim=8),  # its rotary's size, = qk_rope_head_dim (as DeepSeek-V3 sets itself)
    "mamba2": dict(num_heads=8, head_dim=16),  # hidden * expand (2) = heads * head_dim
    # Gemma 3n: the last layers reuse earlier layers' keys and values (15 by default, more than two
    # layers have); four layers, the last two reusing the first two's, as the real models do.
    "gemma3n_text": dict(num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=300,
                         hidden_size_per_layer_input=16, laurel_rank=8,
                         layer_types=["sliding_attention", "full_attention"] * 2),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"], rope_parameters={
        t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}),
}
# Pure state-space / recurrent models: no attention anywhere (the scope is decoder-only
# attention architectures; lmscope refuses them with that sentence).
NO_ATTENTION = ("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm")


def skip_reason(model_type: str) -> str | None:
    """Why `model_type` is not applicable (None: a decoder-only causal LM lmscope should trace)."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as m

    if model_type in m.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or model_type in (
            "bart", "mbart", "pegasus", "marian", "blenderbot", "blenderbot-small", "plbart", "prophetnet",
            "xlm-prophetnet", "bert-generation", "trocr", "whisper", "speech_to_text_2", "pegasus_x"):
        return "the decoder half of an encoder-decoder model"
    if model_type in m.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "an encoder family (its causal-LM head is the encoder with a causal mask)"
    if model_type in NO_ATTENTION:
        return "a state-space or recurrent model with no attention (not a decoder-only attention architecture)"
    cfg_cls = CONFIG_MAPPING[model_type]
    if getattr(cfg_cls, "sub_configs", None):
        return "multimodal or composite (a text model inside sub-configs)"
    return None


def tiny_config(model_type: str):
    """The tiny random config of `model_type` (TINY's fields it has, then FIXES)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in {**TINY, **FIXES.get(model_type, {})}.items() if k in params}
    if "kv_lora_rank" in params:  # multi-head latent attention: head_dim follows qk_rope_head_dim, no GQA
        if "head_dim" not in FIXES.get(model_type, {}):
            kwargs.pop("head_dim", None)
        if "num_key_value_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    return cls(**kwargs)


def _max_diff(a, b) -> float:

    return float((a.float().cpu() - b.float().cpu()).abs().max()) if a.numel() else 0.0


def check_one(model_type: str) -> dict:
    """Build, save, load and compare one type (runs in the worker subprocess)."""
    import torch
    from transformers import AutoModelForCausalLM

    from model_core import load_model, trace
    from model_core.core.errors import PromptError
    from model_core.core.tokenization import byte_tokenizer
    from model_core.serving.generate import generate

    torch.set_num_threads(1)
    config = tiny_config(model_type)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        byte_tokenizer().save_pretrained(d)
        ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        lm = load_model(d, device="cpu", dtype="float32", allow_hub=False)
        ids = lm.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        tr = trace(lm, token_ids=ids)
        with torch.no_grad():
            out = ref(input_ids=torch.tensor([ids]), output_hidden_states=True, output_attentions=True, use_cache=False)
        problems = []
        L = lm.shape.n_layers
        hs = out.hidden_states
        worst = max(_max_diff(tr.resid_pre[i], hs[i][0]) for i in range(L))
        if worst > ATOL:
            problems.append(f"layer inputs differ from output_hidden_states by {worst:.2g}")
        deco = max(_max_diff(tr.resid_post(i), tr.resid_pre[i + 1]) for i in range(L - 1)) if L > 1 else 0.0
        if deco > ATOL:
            problems.append(f"resid_pre + attn_out + mlp_out is not the next layer's input (off by {deco:.2g})")
        attn_layers = list(getattr(lm.adapter, "attention_layers", range(L)))
        atts = out.attentions
        if atts is not None and len(atts) == len(attn_layers) < L:  # a hybrid's: its attention layers' only
            atts = dict(zip(attn_layers, atts))
        if atts is None or any(i >= len(atts) and i not in atts or atts[i] is None for i in attn_layers):
            problems.append("transformers' eager attention returns no attentions to compare with")
        else:
            pat = max(_max_diff(tr.attention_pattern(i), atts[i][0]) for i in attn_layers)
            if pat > ATOL:
                problems.append(f"attention patterns differ from eager output_attentions by {pat:.2g}")
        for i in sorted(set(range(L)) - set(attn_layers)):  # a hybrid's layer without attention says so
            try:
                tr.attention_pattern(i)
                problems.append(f"layer {i} has no attention but returned a pattern")
            except PromptError:
                pass
        with torch.no_grad():
            logits = lm.adapter.logits_from_normed(tr.ln_final)
        lg = max(_max_diff(logits, out.logits[0]), _max_diff(tr.next_logits, out.logits[0, -1]))
        if lg > ATOL:
            problems.append(f"logits differ by {lg:.2g}")
        g = generate(lm, token_ids_prompt(lm, ids), max_new_tokens=NEW_TOKENS, ignore_eos=True)
        with torch.no_grad():
            # No end-of-sequence token on either side (lmscope's ignore_eos): min_new_tokens would instead
            # forbid eos, steering transformers off the argmax wherever the model picks it.
            want = ref.generate(torch.tensor([g.prompt_ids]), max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                do_sample=False, pad_token_id=257)[0, len(g.prompt_ids):].tolist()
        if g.token_ids != want:
            problems.append(f"greedy generation differs ({g.token_ids} vs {want})")
        missing = getattr(lm.adapter, "missing", lambda: [])()
    return {"type": model_type, "status": "fail" if problems else "pass", "reason": "; ".join(problems),
            "adapter": lm.adapter.family, "note": "; ".join(missing)}


def token_ids_prompt(lm, ids) -> str:
    """The prompt text whose byte tokens are `ids` (generate takes text)."""
    return lm.tokenizer.decode(ids)


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "LMSCOPE_ENGINE": os.environ.get("LMSCOPE_ENGINE", "1")}


def run_one(model_type: str) -> dict:
    """check_one in a subprocess with a memory limit and a timeout; a crash is a fail with its last line."""
    try:
        p = subprocess.run([sys.executable, __file__, "--one", model_type], capture_output=True, text=True,
                           timeout=TIMEOUT_S, preexec_fn=_limit, cwd=ROOT, env=_env())
    except subprocess.TimeoutExpired:
        return {"type": model_type, "status": "fail", "reason": f"timed out after {TIMEOUT_S} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    err = [x for x in p.stderr.strip().splitlines() if x.strip()]
    return {"type": model_type, "status": "fail", "reason": err[-1][:300] if err else f"exit {p.returncode}"}


def _check_row(model_type: str) -> dict:
    try:
        return check_one(model_type)
    except Exception as e:  # any failure is a row of the table, with its one line
        first = (str(e).strip().splitlines() or [""])[0][:300]
        return {"type": model_type, "status": "fail", "reason": f"{type(e).__name__}: {first}"}


def _worker(model_type: str) -> None:
    sys.stdout.write(json.dumps(_check_row(model_type)) + "\n")


_ROW = "@@row "  # a result line of a serving worker (anything else on its stdout is the models' chatter)


def _serve() -> None:
    """A long-lived worker: one type name per stdin line, one result line per type on stdout."""
    import gc

    for line in sys.stdin:
        t = line.strip()
        if t:
            row = _check_row(t)
            gc.collect()
            sys.stdout.write(_ROW + json.dumps(row) + "\n")
            sys.stdout.flush()


class _Worker:
    """One `--serve` subprocess (memory limit); restarted after a crash or a timeout."""

    def __init__(self):
        import queue
        import threading

        self.lines: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     preexec_fn=_limit, cwd=ROOT, env=_env())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(_ROW):
                self.lines.put(json.loads(line[len(_ROW):]))
        self.lines.put(None)  # the process ended

    def check(self, model_type: str) -> dict | None:
        """The row, or None when the worker died or timed out (it is then gone)."""
        import queue

        try:
            self.proc.stdin.write(model_type + "\n")
            self.proc.stdin.flush()
            row = self.lines.get(timeout=TIMEOUT_S)
        except (BrokenPipeError, queue.Empty):
            row = None
        if row is None:
            self.stop()
        return row

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def run_many(types: list[str], workers: int | None = None, progress=None) -> list[dict]:
    """Every type's row, in `types` order: not-applicable ones here, the rest checked by `workers`
    long-lived worker processes (default one per core), each restarted when a type crashes it."""
    import threading

    rows: dict[str, dict] = {}
    todo = []
    for t in types:
        why = skip_reason(t)
        if why:
            rows[t] = {"type": t, "status": "not applicable", "reason": why}
        else:
            todo.append(t)
    lock = threading.Lock()

    def slot():
        w = None
        while True:
            with lock:
                if not todo:
                    break
                t = todo.pop(0)
            t0 = time.perf_counter()
            w = w or _Worker()
            row = w.check(t)
            if row is None:  # crashed (memory limit, a native abort) or timed out: a fresh worker
                w = None
                row = {"type": t, "status": "fail", "reason": "the check crashed or timed out"}
            rows[t] = row
            if progress:
                progress(row, time.perf_counter() - t0)
        if w is not None:
            w.proc.stdin.close()
            w.stop()

    n = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    threads = [threading.Thread(target=slot) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return [rows[t] for t in types]


def read_table(path: Path) -> dict[str, str]:
    """{type: status} of a table written by `table`."""
    out = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1] in ("pass", "fail", "not applicable"):
            out[cells[0]] = cells[1]
    return out


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def table(rows: list[dict]) -> str:
    import transformers

    n = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fail", "not applicable")}
    lines = [
        "# Architectures", "",
        "Generated by `bench/architectures.py` (do not edit by hand) against transformers "
        f"{transformers.__version__}: every type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, a tiny random "
        "model of each decoder-only one traced by lmscope and compared with transformers (layer "
        "inputs, residual decomposition, eager attention patterns, logits, greedy generation). Hybrids: "
        "patterns on their attention layers, and their other layers must refuse a pattern in one sentence. "
        "CI re-runs the walk (tests/reference/test_architecture_coverage.py): every pass below must still "
        "pass and the pass count must be the run's.", "",
        f"**{n['pass']} pass, {n['fail']} fail, {n['not applicable']} not applicable, of {len(rows)} types.**", "",
        "| type | status | adapter | reason / note |", "|---|---|---|---|",
    ]
    for r in rows:
        text = r.get("reason") or r.get("note") or ""
        lines.append(f"| {r['type']} | {r['status']} | {r.get('adapter', '')} | {text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated model types (default: all)")
    ap.add_argument("--write", help="write the markdown table here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, help="worker processes (default: one per core)")
    args = ap.parse_args(argv)
    if args.one:
        return _worker(args.one)
    if args.serve:
        return _serve()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    types = args.types.split(",") if args.types else all_types()
    rows = run_many(types, args.workers, progress=lambda row, sec: log.info(
        "%-24s %-15s %5.1fs %s", row["type"], row["status"], sec, row.get("reason") or ""))
    md = table(rows)
    if args.write:
        Path(args.write).write_text(md)
    else:
        sys.stdout.write(md)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
