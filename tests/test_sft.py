"""Chat fine-tuning: tokenizers trained by train.py carry a chat template (ChatML) with its special tokens, and the
README's SFT command (`trl sft`, TRL as an optional extra) runs on a train.py checkpoint and a conversational dataset
built here; its output loads by remote code and answers through the template."""

import json
import os
import re
import shlex
import subprocess
import sys

from conftest import tiny_tokenizer
from test_train import ROOT, env, text_file, trained  # noqa: F401 (fixtures)


CHAT = [{"role": "system", "content": "Speak as a player."}, {"role": "user", "content": "Who art thou?"},
        {"role": "assistant", "content": "I am Romeo."}]


def test_trained_tokenizer_has_a_chat_template(tmp_path):
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert text == ("<|im_start|>system\nSpeak as a player.<|im_end|>\n<|im_start|>user\nWho art thou?<|im_end|>\n"
                    "<|im_start|>assistant\nI am Romeo.<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert tokenizer.unk_token_id not in (start, end) and start != end
    # Each marker is one token, and the assistant mask covers the reply and its end-of-turn token only.
    out = tokenizer.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids.count(start) == 3 and ids.count(end) == 3
    reply = [i for i, m in zip(ids, mask) if m]
    assert tokenizer.decode(reply) == "I am Romeo.<|im_end|>"
    assert "<|im_start|>" not in tokenizer.decode(ids, skip_special_tokens=True)
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(CHAT, tokenize=False) == text


def test_train_py_checkpoint_carries_the_template(trained):
    from transformers import AutoTokenizer

    out, _ = trained
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tokenizer.apply_chat_template(CHAT, tokenize=False).startswith("<|im_start|>system\n")


GENERATE = """
import sys
sys.modules["ddl"] = None
from transformers import AutoModelForCausalLM, AutoTokenizer
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
ids = tokenizer.apply_chat_template([{"role": "user", "content": "Who art thou?"}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)
new = model.generate(**ids, max_new_tokens=4, do_sample=False)[0, ids["input_ids"].shape[1]:]
assert tokenizer.eos_token == "<|im_end|>", tokenizer.eos_token
print("OK", repr(tokenizer.decode(new)))
"""


def test_sft_command_runs_on_a_train_py_checkpoint(trained, tmp_path):
    """The README's `trl sft` command, with a tiny conversational dataset (JSON lines of `messages`), 2 steps."""
    base, _ = trained
    data = tmp_path / "chats"
    data.mkdir()
    with open(data / "train.jsonl", "w") as f:
        for name in ("Romeo", "Juliet", "Hamlet", "Lear") * 4:
            f.write(json.dumps({"messages": [{"role": "user", "content": "Who art thou?"},
                                             {"role": "assistant", "content": f"I am {name}."}]}) + "\n")
    out = tmp_path / "sft"
    args = readme_sft_command()
    for flag, value in (("--model_name_or_path", base), ("--dataset_name", data), ("--output_dir", out)):
        args[args.index(flag) + 1] = str(value)
    trl = [sys.executable, "-c", "import sys; from trl.cli import main; sys.argv[0] = 'trl'; sys.exit(main())"]
    cmd = trl + args + ["--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1",
                        "--report_to", "none", "--use_cpu"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(HF_HOME=str(tmp_path / "hf")), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2]
    environment = env(HF_HOME=str(tmp_path / "hf"))
    environment.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(out)], cwd=tmp_path, env=environment,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-4000:]


def readme_sft_command() -> list[str]:
    """The README's `trl sft ...` command (continued lines joined), as arguments after `trl`."""
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    match = re.search(r"^trl (sft .*?)(?<!\\)$", readme, re.M | re.S)
    assert match, "README.md shows no `trl sft` command"
    return shlex.split(match.group(1).replace("\\\n", " ").split("#")[0])
