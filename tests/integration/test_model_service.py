"""A model process reached by its address, as docker-compose.yml's model service runs one: started on
its own with the compose file's command (its key given in LMSCOPE_MODEL_PROCESS_KEY, as on another
host), and `lmscope serve` pointed at it with LMSCOPE_MODEL_PROCESS=tcp://host:port. Real parts: both
processes, real sockets, a page session's Generate. The model is random-gemma3-tiny (the mechanics, and greedy text that varies;
the real default model through a model process: tests/integration/test_model_process.py), its greedy
text checked against transformers' own `generate` on the same seeded weights. A web server holding
another key is not served by it, and says so on /healthz."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.helpers.browser import LiveServer, free_port, wait_until
from tests.helpers.raw_client import RawClient

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "random-gemma3-tiny"
PROMPT = "Once upon a time"
NEW_TOKENS = 24


def health(server) -> dict:
    return json.loads(urllib.request.urlopen(server.url + "healthz", timeout=5).read())


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The compose file's model service command, on loopback instead of 0.0.0.0."""
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["model"]["command"]
    port = free_port()
    command = [sys.executable if c == "python" else c.replace("tcp://0.0.0.0:7861", f"tcp://127.0.0.1:{port}")
               for c in command]
    key = secrets.token_hex(32)
    env = {**os.environ, "LMSCOPE_DEVICE": "cpu", "LMSCOPE_DEFAULT_MODEL": MODEL, "LMSCOPE_MODEL_PROCESS_KEY": key,
           "LMSCOPE_DATA_DIR": str(tmp_path_factory.mktemp("model-data"))}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        yield f"tcp://127.0.0.1:{port}", key, proc.pid
    finally:
        proc.kill()
        proc.wait(10)


def serve(address: str, key: str, data_dir) -> LiveServer:
    return LiveServer(extra_env={"LMSCOPE_MODEL_PROCESS": address, "LMSCOPE_MODEL_PROCESS_KEY": key,
                                 "LMSCOPE_DEFAULT_MODEL": MODEL, "LMSCOPE_DATA_DIR": str(data_dir)})


def hf_greedy_text() -> str:
    """transformers' own greedy `generate` on the same seeded random weights (the reference)."""
    import torch

    from model_core import load_model

    lm = load_model(MODEL, device="cpu")
    ids = lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = lm.model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids),
                                pad_token_id=lm.tokenizer.pad_token_id or 0)
    new = out[0, ids.shape[1]:].tolist()
    eos = lm.tokenizer.eos_token_id
    if eos in new:  # the lab stops at EOS, as generate does for a lone row
        new = new[: new.index(eos)]
    return lm.tokenizer.decode(new)


def test_a_model_service_reached_by_address_generates_what_transformers_generates(service, tmp_path):
    address, key, pid = service
    server = serve(address, key, tmp_path / "web-data")
    try:
        wait_until(lambda: health(server)["model_processes"][0]["state"] == "ready", timeout=120,
                   what="the model service answering the web server")
        listed = health(server)["model_processes"][0]
        assert listed["pid"] == pid and listed["address"] == address and listed["device"] == "cpu"
        assert "model_process" not in health(server).get("down", {})
        c = RawClient(server.url)
        fn = c.fn("generate")
        given = {"Model": MODEL, "Prompt": PROMPT, "max new tokens": NEW_TOKENS, "temperature (0 = greedy)": 0.0}
        out = c.call(fn, c.data_for(fn, given))
        assert "error" not in out, out
        labels = [c.components[i].get("props", {}).get("label") for i in c.deps[fn]["outputs"]]
        text = out["data"][labels.index("generated text")]
        text = text["value"] if isinstance(text, dict) else text
        assert text == hf_greedy_text()
        assert listed["in_flight"] == 0 and health(server)["model_processes"][0]["in_flight"] == 0
    finally:
        server.stop()


def test_a_web_server_with_another_key_is_not_served(service, tmp_path):
    from model_core.serving.model_process_client import ModelProcessClient

    address, key, _ = service
    right = ModelProcessClient(address, bytes.fromhex(key))
    try:  # the service answers the right key (so silence below is the key's doing)
        assert right.wait_ready(120)
    finally:
        right.close()
    server = serve(address, secrets.token_hex(32), tmp_path / "web-data")
    try:
        time.sleep(3)  # the client pings every 0.2 s until answered: an answer would have come by now
        body = health(server)
        assert body["model_processes"][0]["state"] == "starting" and body["model_processes"][0]["pid"] is None
        assert body["status"] == "degraded" and "generations wait for it" in body["down"]["model_process"]
    finally:
        server.stop()
