"""`transformers serve` serves a DDL checkpoint as a user runs it: `transformers serve <folder> --trust-remote-code`,
a Hub id from an offline HF cache, and --continuous-batching (whose paged cache cannot hold EC's history: serve falls
back to `generate`), on 127.0.0.1 in fresh processes that never import `ddl` (the checkpoint's own code serves it).
A chat completion's reply is `apply_chat_template` then greedy `generate`."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers.utils.import_utils import is_serve_available

from conftest import in_hf_cache, tiny_config, tiny_tokenizer, trained_looking
from ddl import DDLForCausalLM


pytestmark = pytest.mark.skipif(not is_serve_available(), reason="needs transformers[serving] (fastapi, uvicorn, "
                                                                  "openai)")

MESSAGES = [{"role": "user", "content": "To be, or not to be"}]
MAX_TOKENS = 6


def _free_port():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    except OSError as error:
        pytest.skip(f"no loopback port to serve on: {error}")


def _post(port, path, body, timeout=120):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _serve(model, port, env, log, *flags):
    """`transformers serve <model> --trust-remote-code [flags]` on 127.0.0.1:port (its output in `log`)."""
    command = [os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", model, "--trust-remote-code",
               "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", *flags]
    return subprocess.Popen(command, env=env, cwd=log.parent, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _wait_until_up(process, port, log, deadline):
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"transformers serve exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.5)
    pytest.fail(f"transformers serve did not start:\n{log.read_text()[-3000:]}")


def test_transformers_serve_answers_a_chat_as_generate(tmp_path):
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = trained_looking(DDLForCausalLM(config), scale=0.3).eval()  # the default variant: d_v = 4, CC + EC
    folder = tmp_path / "ddl-tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    in_hf_cache(folder, tmp_path / "hf", "ddl-tests/tiny")

    inputs = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert expected.strip()

    # a fresh process, which imports no `ddl`: the checkpoint's own code serves it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DDL_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONSAFEPATH="1")
    servers = {}
    try:
        # --continuous-batching: its paged cache cannot hold EC's history, so serve falls back to generate
        for name, model_id, flags in (("folder", str(folder), ()), ("cache", "ddl-tests/tiny", ()),
                                      ("continuous-batching", str(folder), ("--continuous-batching",))):
            port, log = _free_port(), tmp_path / f"serve-{name}.log"
            servers[name] = (model_id, port, log, _serve(model_id, port, env, log, *flags))
        deadline = time.monotonic() + 180
        for name, (model_id, port, log, process) in servers.items():
            _wait_until_up(process, port, log, deadline)
            reply = _post(port, "/v1/chat/completions", {"model": model_id, "messages": MESSAGES,
                                                         "max_tokens": MAX_TOKENS})
            assert reply["choices"][0]["message"]["content"] == expected, (name, log.read_text()[-2000:])
        assert "does not support continuous batching" in servers["continuous-batching"][2].read_text()
    finally:
        for _, _, _, process in servers.values():
            process.terminate()
            process.wait(timeout=30)
