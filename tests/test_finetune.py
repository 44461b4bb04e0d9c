"""Fine-tuning. LoRA with PEFT: the default targets and DDL's own parameters (ddl_tools/lora.py), and `train.py
--lora`, which saves the adapter and a merged model that loads by remote code and computes what base + adapter
compute. Chat: tokenizers trained by train.py carry a chat template (ChatML) with its special tokens, and
docs/training.md's SFT command (`trl sft`, TRL as an optional extra) runs on a train.py checkpoint and a conversational dataset built
here; its output loads by remote code and answers through the template."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import tiny_config, tiny_tokenizer
from test_hub import load_in_fresh_process
from test_train import ROOT, TINY_RUN, env, llama_dir, run_train, text_file, trained  # noqa: F401 (fixtures)

TRAINING_DOC = open(os.path.join(ROOT, "docs", "training.md"), encoding="utf-8").read()  # where the commands live


def randomised(model, seed=0):
    """Trained-looking weights: init would leave LoRA's B (and so its update) and many DDL tensors at constants."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def own_parameters(model):
    """DDL's own parameters: those a LlamaForCausalLM of the same shape does not have."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in model.config.to_dict().items()
              if not k.startswith("ddl_") and k not in ("model_type", "layer_types", "auto_map")}
    return {name for name, _ in model.named_parameters()} - set(LlamaForCausalLM(LlamaConfig(**fields)).state_dict())


def trained_in_full(peft_model):
    """The base-model names of the parameters PEFT trains as full copies (`modules_to_save`)."""
    return {n.replace("base_model.model.", "", 1).replace(".modules_to_save.default", "")
            for n, p in peft_model.named_parameters() if p.requires_grad and ".modules_to_save." in n}


VARIANTS = {
    "dv4-tc-ec-gate-mlp": dict(ddl_compressor="tc", ddl_beta_hidden_size=8),
    "dv4-cc": dict(ddl_compressor="cc", ddl_embed_conv=False),
    "dv1-delta": dict(ddl_value_channels=1),
    "llama": dict(ddl_value_channels=1, ddl_residual="additive"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lora_config_adapts_the_projections_and_trains_ddl_branch_in_full(variant):
    """Oracle: DDL's own parameters are those a LlamaForCausalLM of the same shape does not have."""
    from peft import get_peft_model

    import ddl
    from ddl_tools.lora import LORA_TARGET_MODULES, lora_config

    config = tiny_config(**VARIANTS[variant])
    model = randomised(ddl.DDLForCausalLM(config))
    own = own_parameters(model)
    assert bool(own) == (variant != "llama")

    peft_model = get_peft_model(model, lora_config(model, r=4))
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trained_in_full(peft_model) == own
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[1] for n in trainable if ".lora_A." in n}
    assert adapted == set(LORA_TARGET_MODULES)
    assert sum(".lora_A." in n for n in trainable) == len(LORA_TARGET_MODULES) * config.num_hidden_layers
    assert trainable == {n for n in trainable if ".lora_" in n or ".modules_to_save." in n}

    frozen = get_peft_model(randomised(ddl.DDLForCausalLM(config)), lora_config(model, r=4, train_ddl_branch=False))
    assert all(".lora_" in n for n, p in frozen.named_parameters() if p.requires_grad)


def test_lora_on_a_model_built_from_a_llama_trains_its_fresh_qk_norms(tmp_path):
    """A Llama has no QK-norm: a DDL built from one with qk_norm starts its q_norm/k_norm at ones, so --lora trains
    them in full with DDL's branch; fine-tuning a DDL checkpoint keeps its trained norms frozen, as Llama's are."""
    from types import SimpleNamespace

    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from ddl_tools.loading import load_from_llama
    from ddl_tools.lora import add_lora
    from ddl_tools.presets import ddl_config_from_llama

    llama = LlamaConfig(vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    LlamaForCausalLM(llama).save_pretrained(tmp_path)
    model = load_from_llama(str(tmp_path), ddl_config_from_llama(llama, {"qk_norm": True}))
    args = SimpleNamespace(model_name_or_path=None, lora_target_modules=None, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                           lora_train_ddl_branch=True, init_from_llama=str(tmp_path))
    norms, own = {n for n, _ in model.named_parameters() if ".q_norm." in n or ".k_norm." in n}, own_parameters(model)
    assert norms <= own and trained_in_full(add_lora(model, args, verbose=False)) == own
    checkpoint = randomised(load_from_llama(str(tmp_path), ddl_config_from_llama(llama, {"qk_norm": True})))
    args.init_from_llama = None  # (as if it were a DDL checkpoint given by --model_name_or_path)
    assert not trained_in_full(add_lora(checkpoint, args, verbose=False)) & norms


@pytest.mark.parametrize("variant", ["dv4-tc-ec-gate-mlp", "dv1-delta"])
def test_readme_peft_config_trains_the_ddl_branch(variant):
    """docs/training.md's `LoraConfig` for PEFT users: LoRA on the projections, every DDL parameter trained in full."""
    import ddl

    snippet = re.search(r"```python\n(from peft import LoraConfig.*?)```", TRAINING_DOC, re.S).group(1)
    namespace = {"model": randomised(ddl.DDLForCausalLM(tiny_config(**VARIANTS[variant])))}
    own = own_parameters(namespace["model"])
    exec(compile(snippet, "docs/training.md", "exec"), namespace)
    assert trained_in_full(namespace["model"]) == own
    assert any(".lora_A." in n for n, p in namespace["model"].named_parameters() if p.requires_grad)


def test_train_lora_saves_adapter_and_a_merged_model(trained, tmp_path, text_file):  # noqa: F811
    """`--lora` on a trained DDL checkpoint: the output folder is the merged model (remote code, no `ddl`), equal to
    base + adapter; the adapter is in adapter/; LoRA moved the projections, the DDL branch trained in full, the
    embeddings and norms stayed."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import ddl  # noqa: F401

    base, _ = trained
    out = tmp_path / "lora"
    relative = os.path.relpath(base, ROOT)  # (train.py runs in ROOT)
    proc = run_train("--model_name_or_path", relative, "--train_file", str(text_file), "--output_dir", str(out),
                     *TINY_RUN, "--lora", "--lora_r", "4", "--max_steps", "3", "--eval_steps", "3", "--save_steps", "3",
                     "--learning_rate", "1e-2")
    assert "LoRA: r 4" in proc.stdout and "DDL branch trained in full" in proc.stdout
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["r"] == 4
    # a checkpoint's adapter names its base as a path from anywhere (eval.py of it from another folder loaded that
    # folder's model of the same relative name, silently)
    recorded = json.loads((out / "checkpoint-3" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(base.resolve()) and relative != recorded
    assert "Fine-tuning: LoRA (r 4" in (out / "README.md").read_text()

    before, after = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.layers.1.mlp.down_proj.weight" in changed
    assert {"model.layers.0.attn_delta.value_weight", "model.layers.1.compress.conv_weight",
            "model.embed_conv.weight", "model.readout.read"} <= changed
    assert not {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"} & changed

    merged = AutoModelForCausalLM.from_pretrained(out)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "adapter")
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=1e-4, atol=1e-5)
    load_in_fresh_process(tmp_path, [out])


LORA_BAD_INPUTS = {
    "no-checkpoint": ([], "--lora adapts a trained model"),
    "unknown-target": (["--model_name_or_path", "{base}", "--lora_target_modules", "q_proj,nope"],
                       "no module named ['nope']"),
    # (PEFT's own message: a ValueError naming the module's whole repr and every layer type it supports)
    "ddl-module-target": (["--model_name_or_path", "{base}", "--lora_target_modules", "q_proj,attn_delta"],
                          "['attn_delta']: not a linear layer or embedding LoRA can adapt (DDLDeltaResidual); DDL's "
                          "own ['attn_delta'] train in full"),
    "norm-and-unknown-targets": (["--model_name_or_path", "{base}", "--lora_target_modules", "q_proj,nope,mlp"],
                                 "no module named ['nope']; ['mlp']: not a linear layer or embedding LoRA can adapt "
                                 "(LlamaMLP); its linear layers"),
    "whole-model-checkpoint": (["--model_name_or_path", "{base}", "--resume_from_checkpoint", "{base}/checkpoint-3"],
                               "holds a whole model, not a LoRA adapter: resume its run without --lora"),
}


@pytest.mark.parametrize("case", list(LORA_BAD_INPUTS))
def test_lora_bad_input_is_one_line(case, trained, tmp_path, text_file, capsys):  # noqa: F811
    import train

    extra, message = LORA_BAD_INPUTS[case]
    args = ["--train_file", str(text_file), "--output_dir", str(tmp_path / "out"), *TINY_RUN, "--max_steps", "1",
            "--lora", *[a.format(base=trained[0]) for a in extra]]
    assert train.cli(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err[-2000:]


# ---------------------------------------------------------------------------------------------- chat (SFT)


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


def test_train_py_checkpoint_carries_the_template(trained):  # noqa: F811
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


def test_sft_command_runs_on_a_train_py_checkpoint(trained, tmp_path):  # noqa: F811
    """docs/training.md's `trl sft` command (on a CPU with --use_cpu, as it says), with a tiny conversational dataset
    (JSON lines of `messages`), 2 steps."""
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
    """docs/training.md's `trl sft ...` command (continued lines joined), as arguments after `trl`."""
    match = re.search(r"^trl (sft .*?)(?<!\\)$", TRAINING_DOC, re.M | re.S)
    assert match, "docs/training.md shows no `trl sft` command"
    return shlex.split(match.group(1).replace("\\\n", " ").split("#")[0])


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resuming_a_finished_fine_tune_keeps_its_weights(lora, trained, tmp_path, text_file):  # noqa: F811
    """A fine-tune (--model_name_or_path, with or without --lora) resumed at its last checkpoint, as after a Ctrl-C in
    its final evaluation or save: train.py skips Trainer.train, which is what loads a checkpoint, so the final folder
    got the untouched base model (and a fresh adapter) under the fine-tune's numbers (found by a user-style test
    pass). It now holds the checkpoint's weights."""
    from safetensors.torch import load_file

    base, _ = trained
    out = tmp_path / "ft"
    args = ["--model_name_or_path", str(base), "--train_file", str(text_file), "--output_dir", str(out), *TINY_RUN,
            "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--learning_rate", "1e-2",
            *(["--lora", "--lora_r", "4"] if lora else [])]
    run_train(*args)
    tuned = load_file(str(out / "model.safetensors"))
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors")) if lora else {}
    if lora:  # the README's resume command without the run's --lora and base was a traceback: one line naming them
        bare = run_train("--train_file", str(text_file), "--output_dir", str(out), *TINY_RUN,
                         "--resume_from_checkpoint", "true", check=False)
        assert bare.returncode == 2 and f"--model_name_or_path {base} --lora" in bare.stderr, bare.stderr[-2000:]
    proc = run_train(*args, "--resume_from_checkpoint", "true")
    assert "no step left to train" in proc.stdout
    again = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(tuned[k], again[k]) for k in tuned)
    for key, value in (load_file(str(out / "adapter" / "adapter_model.safetensors")) if lora else {}).items():
        assert torch.equal(adapter[key], value), key


def test_a_lora_run_from_a_llama_with_ddl_flags_resumes_with_them(llama_dir, tmp_path, text_file):  # noqa: F811
    """A --lora run built from a Llama with a --ddl_* flag (--qk_norm) could not be resumed: its adapter checkpoint
    has no config.json, and the flag was compared with a default config ("--qk_norm = True (it has False)"). Without
    the flag, the resume shipped a model without the QK-norms the adapter trained. Now the run resumes with its own
    flags (here at its end: its weights); other model flags (also one that changes no tensor's shape) or LoRA
    settings are one line each."""
    from safetensors.torch import load_file

    out = tmp_path / "ft"
    bare_args = ["--init_from_llama", str(llama_dir), "--train_file", str(text_file), "--output_dir", str(out),
                 *TINY_RUN, "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--learning_rate", "1e-2",
                 "--lora", "--lora_r", "4"]
    args = [*bare_args, "--qk_norm", "true"]
    run_train(*args)
    tuned = load_file(str(out / "model.safetensors"))
    assert any(".q_norm." in key for key in tuned)
    for name in ("model.safetensors", "README.md"):  # as if stopped in its final save
        (out / name).unlink()
    for other, message in (([], "qk_norm = False (it has True)"),  # (a tensor less)
                           (["--qk_norm", "true", "--ddl_k_eps", "0.5"], "ddl_k_eps = 0.5 (it has 1e-05)"),  # (none)
                           (["--qk_norm", "true", "--lora_r", "8"], "--lora_r 8 (it has 4)")):
        bare = run_train(*bare_args, *other, "--resume_from_checkpoint", "true", check=False)
        assert bare.returncode == 2 and message in bare.stderr, bare.stderr[-2000:]
        assert "Traceback" not in bare.stderr and not (out / "model.safetensors").exists()
    proc = run_train(*args, "--resume_from_checkpoint", "true")
    assert "no step left to train" in proc.stdout
    again = load_file(str(out / "model.safetensors"))
    assert tuned.keys() == again.keys() and all(torch.equal(tuned[k], again[k]) for k in tuned)
