"""train.py end to end, in subprocesses, at tiny sizes (hidden 32, 2 layers, vocab 300, a few steps each).

Covers: a loadable checkpoint that a fresh process without `ddl` on its path generates from (trust_remote_code);
resume after an interruption reaches the uninterrupted loss; `--init_from_llama` with the additive residual is that
Llama exactly; 2-process DDP under torchrun (gloo on CPU); bad inputs give one clear line and a non-zero exit; the
output folder's safety: one run at a time, a resume that continues its checkpoint (model, blocks, data, tokenizer)
and skips a damaged one, a full disk or a diverging run stopped in one line with the folder left resumable.
"""

import json
import math
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from huggingface_hub import ModelCard


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train.py")
sys.path.insert(0, ROOT)

from conftest import run_cli as run_script_cli  # noqa: E402
from ddl_tools.data import (  # noqa: E402
    ensure_validation_split,
    load_raw_datasets,
    tokenize_and_pack,
    train_bpe_tokenizer,
)
from ddl_tools.loading import load_from_llama  # noqa: E402
from ddl_tools.presets import ddl_config_from_llama  # noqa: E402


TINY_MODEL = "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,head_dim=16"
TINY_RUN = [
    "--vocab_size", "300", "--block_size", "32", "--per_device_train_batch_size", "4",
    "--per_device_eval_batch_size", "8", "--max_eval_samples", "8", "--logging_steps", "1",
    "--report_to", "none", "--use_cpu", "--sample_max_new_tokens", "8", "--dataloader_num_workers", "0",
]
WORDS = ("the king queen lord lady crown sword night day love death heart blood fair foul speak hear go come "
         "thou thee my our your good ill sweet bitter time world man woman fool wise").split()


def env(**extra):
    """The parent's environment with single-threaded torch (tests run side by side on 2 cores) and no Hub."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "CUDA_VISIBLE_DEVICES": "", **extra}


def run_train(*args, check=True, timeout=300, launcher=None, env_extra=None):
    cmd = (launcher or [sys.executable]) + [TRAIN, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(**(env_extra or {})), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def tiny(out, text_file, *extra):
    return ["--train_file", str(text_file), "--output_dir", str(out), "--config_overrides", TINY_MODEL,
            *TINY_RUN, *extra]


def logged_losses(folder) -> dict[int, float]:
    with open(os.path.join(folder, "trainer_state.json")) as f:
        return {e["step"]: e["loss"] for e in json.load(f)["log_history"] if "loss" in e}


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(1500)]
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, text_file):
    out = tmp_path_factory.mktemp("run") / "ckpt"
    proc = run_train(*tiny(out, text_file, "--max_steps", "3", "--eval_steps", "3", "--save_steps", "3"))
    return out, proc


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, text_file):
    """A random tiny LlamaForCausalLM saved with a tokenizer trained here (no Hub)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama")
    tokenizer = train_bpe_tokenizer([text_file.read_text().splitlines()], vocab_size=300)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_checkpoint_is_complete(trained):
    out, proc = trained
    for name in ("model.safetensors", "config.json", "configuration_ddl.py", "modeling_ddl.py", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json", "trainer_state.json", "README.md",
                 "loss_curve.png"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_ddl.DDLConfig", "AutoModel": "modeling_ddl.DDLModel",
                                  "AutoModelForCausalLM": "modeling_ddl.DDLForCausalLM",
                                  "AutoModelForDecision": "modeling_ddl.DDLForCausalLM",  # (transformers serve)
                                  "AutoModelForSequenceClassification": "modeling_ddl.DDLForSequenceClassification",
                                  "AutoModelForTokenClassification": "modeling_ddl.DDLForTokenClassification",
                                  "AutoModelForQuestionAnswering": "modeling_ddl.DDLForQuestionAnswering"}
    assert config["use_cache"] is True and config["ddl_value_channels"] == 4 and config["ddl_residual"] == "delta"
    card = (out / "README.md").read_text()
    for needle in ("DDL-CC (d_v=4)", "trust_remote_code=True", "loss_curve.png", "validation", "Tokens seen: 384",
                   "under the Apache-2.0 license"):
        assert needle in card, needle
    assert ModelCard.load(out / "README.md").data.license == "apache-2.0"  # the code's, unless --license says otherwise
    results = json.loads((out / "all_results.json").read_text())
    assert math.isfinite(results["eval_loss"]) and results["tokens_seen"] == 3 * 4 * 32
    assert "sample from" in proc.stdout
    # the steady rate: step 3 alone (after the first two; the evaluation and save came after it)
    assert results["train_steady_steps"] == 1 and results["precision"] == "float32" and results["compiled"] is False
    rate = 4 * 32 / results["train_steady_seconds"]
    line = f"steady {rate:,.0f} tokens/s over 1 steps, without the first two, evaluations and saves); float32, not "
    assert line in card and line in proc.stdout


def test_a_plain_cpu_run_prints_nothing_of_deepspeed(trained):
    """DeepSpeed is installed (for configs/deepspeed_*.yaml) but a plain run does not use it: accelerate's
    unwrap_model, which Trainer calls, imported it all the same, and its import printed "Setting accelerator to CPU.
    If you have GPU or other accelerator, we were unable to detect it." into every `python train.py`."""
    _, proc = trained
    output = proc.stdout + proc.stderr
    assert "Setting accelerator" not in output and "real_accelerator" not in output, output[-3000:]


def test_reload_in_fresh_process_without_ddl(trained, tmp_path):
    """The folder alone is enough: another cwd, and `import ddl` fails (as for someone who never installed it);
    remote code does the work."""
    out, _ = trained
    script = f"""
import sys, torch
sys.modules["ddl"] = None  # `import ddl` raises ImportError, also where this checkout is installed
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, pipeline
path = {str(out)!r}
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
assert AutoModel.from_pretrained(path, trust_remote_code=True).config.model_type == "ddl"
ids = tokenizer("The king", return_tensors="pt")
torch.manual_seed(0)
new = model.generate(**ids, max_new_tokens=6)[0, ids["input_ids"].shape[1]:]
assert new.numel() > 0
text = pipeline("text-generation", model=model, tokenizer=tokenizer)("The king", max_new_tokens=6)[0]
assert text["generated_text"].startswith("The king")
print("OK", tokenizer.decode(new))
"""
    environment = env(HF_HOME=str(tmp_path / "hf"))
    environment.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OK" in proc.stdout


def test_fine_tune_from_the_checkpoint(trained, tmp_path, text_file):
    """--model_name_or_path continues from a DDL folder with its own tokenizer, architecture and weights (learning
    rate 0: the saved weights must be the checkpoint's, which a freshly initialised model would not give)."""
    from safetensors.torch import load_file

    checkpoint, _ = trained
    out = tmp_path / "finetuned"
    run_train("--model_name_or_path", str(checkpoint), "--train_file", str(text_file), "--output_dir", str(out),
              *TINY_RUN, "--max_steps", "2", "--eval_steps", "2", "--save_steps", "2", "--learning_rate", "0",
              "--license", "mit")
    loaded, saved = (load_file(str(d / "model.safetensors")) for d in (checkpoint, out))
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in loaded)
    before, after = (json.loads((d / "config.json").read_text()) for d in (checkpoint, out))
    assert {k: v for k, v in after.items() if k != "use_cache"} == {k: v for k, v in before.items() if k != "use_cache"}
    assert (out / "tokenizer.json").read_text() == (checkpoint / "tokenizer.json").read_text()
    assert "from the DDL checkpoint" in (out / "README.md").read_text()
    card = ModelCard.load(out / "README.md").data
    assert (card.license, card.library_name, card.pipeline_tag) == ("mit", "transformers", "text-generation")
    assert card.base_model is None  # its base was trained from scratch here: nothing on the Hub to name
    # the published arguments name the output folder by its name, not by where it lay on this machine
    assert json.loads((out / "training_args.json").read_text())["output_dir"] == "finetuned"
    assert str(tmp_path) not in (out / "training_args.json").read_text()


def test_a_training_switch_applies_to_the_checkpoint_it_fine_tunes(trained, tmp_path, text_file):
    """--ddl_rebuild_states switches how training runs, not what the model is: with --model_name_or_path it is not
    refused as the shaping --ddl_* flags are (it was), and the fine-tuned model's config has it."""
    checkpoint, _ = trained
    out = tmp_path / "kept"
    run_train("--model_name_or_path", str(checkpoint), "--train_file", str(text_file), "--output_dir", str(out),
              *TINY_RUN, "--max_steps", "1", "--eval_steps", "1", "--save_steps", "1", "--ddl_rebuild_states", "False")
    assert json.loads((checkpoint / "config.json").read_text())["ddl_rebuild_states"] is True  # (the default)
    assert json.loads((out / "config.json").read_text())["ddl_rebuild_states"] is False


def test_every_variant_field_of_the_config_is_a_flag():
    """train.py's --ddl_* flags are DDLConfig's fields (derived from it: 11 hand-written flags covered 18 fields),
    unset unless given, and reach the model's config."""
    import dataclasses

    import train
    from ddl import DDLConfig
    from ddl_tools.presets import preset_config

    fields = {f.name for f in dataclasses.fields(DDLConfig) if f.name.startswith(("ddl_", "qk_norm"))}
    model_args = train.parse_args(["--output_dir", "unused"])[0]
    assert set(model_args.ddl_flags()) | set(train.TRAINING_SWITCHES) == fields
    assert set(model_args.ddl_flags().values()) == {None} and model_args.ddl_switches() == {}
    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(type(model_args)) if f.name in fields}
    assert not [name for name, text in helps.items() if text == "See DDLConfig."]  # each read from the docstring
    model_args = train.parse_args(["--ddl_v_constant", "0.5", "--qk_norm_position", "before_rope", "--ddl_cc_form",
                                   "matrix", "--ddl_shared_compressor", "false", "--ddl_init_std_factor", "0.25"])[0]
    given = {k: v for k, v in model_args.ddl_flags().items() if v is not None}
    config = preset_config("tiny", 300, **given)
    assert (config.ddl_v_constant, config.qk_norm_position, config.ddl_cc_form, config.ddl_shared_compressor,
            config.ddl_init_std_factor) == (0.5, "before_rope", "matrix", False, 0.25)


def test_card_metadata_names_the_license_hub_dataset_and_base(tmp_path):
    from ddl_tools.card import card_metadata

    assert card_metadata(license_id=None, dataset_name=None, base=None) == {}
    hub = card_metadata(license_id="apache-2.0", dataset_name="HuggingFaceFW/fineweb-edu", base="meta-llama/Llama-3.2-1B")
    assert hub == {"license": "apache-2.0", "datasets": ["HuggingFaceFW/fineweb-edu"], "base_model": "meta-llama/Llama-3.2-1B",
        "base_model_relation": "finetune"}
    local = tmp_path / "ddl-from-llama"  # a local fine-tune names its own card's base: the lineage on the Hub
    local.mkdir()
    (local / "README.md").write_text("---\nbase_model: meta-llama/Llama-3.2-1B\n---\n# a fine-tune\n")
    assert card_metadata(license_id=None, dataset_name=str(tmp_path), base=str(local)) == {
        "base_model": "meta-llama/Llama-3.2-1B", "base_model_relation": "finetune"}


def test_streaming_with_gradient_checkpointing(tmp_path, text_file):
    """A streamed dataset (validation carved from its start) and gradient checkpointing, a few steps."""
    out = tmp_path / "streamed"
    proc = run_train(*tiny(out, text_file, "--streaming", "--streaming_validation_examples", "200", "--max_steps", "2",
                           "--eval_steps", "2", "--save_steps", "2", "--gradient_checkpointing"))
    assert "(streaming)" in proc.stdout
    results = json.loads((out / "all_results.json").read_text())
    assert math.isfinite(results["eval_loss"]) and results["tokens_seen"] == 2 * 4 * 32
    assert (out / "model.safetensors").is_file()


def test_resume_reaches_the_uninterrupted_loss(tmp_path, text_file):
    """Run A trains 2N steps. Run B is an interrupted run: an output folder holding only A's checkpoint at step N
    (what a run killed after its step-N save leaves behind). Resumed, B must log A's loss at step 2N."""
    n = 3
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    run_train(*tiny(full, text_file, "--max_steps", str(2 * n), "--save_steps", str(n), "--eval_steps", "100"))
    interrupted.mkdir()
    shutil.copytree(full / f"checkpoint-{n}", interrupted / f"checkpoint-{n}")
    args = tiny(interrupted, text_file, "--max_steps", str(2 * n), "--save_steps", str(n), "--eval_steps", "100")
    refused = run_train(*args, check=False)
    assert refused.returncode != 0 and "--resume_from_checkpoint true" in refused.stderr
    run_train(*args, "--resume_from_checkpoint", "true")
    expected, resumed = logged_losses(full), logged_losses(interrupted)
    assert min(resumed) <= n + 1 and 2 * n in resumed
    assert resumed[2 * n] == pytest.approx(expected[2 * n], rel=1e-5, abs=1e-6)
    assert resumed[n + 1] == pytest.approx(expected[n + 1], rel=1e-5, abs=1e-6)
    # the card's speed counts the N steps this run trained, not all 2N
    results = json.loads((interrupted / "all_results.json").read_text())
    assert results["resumed_at_step"] == n
    rate = results["tokens_seen"] / 2 / results["train_runtime"]
    card = (interrupted / "README.md").read_text()
    assert f"({rate:,.0f} tokens/s " in card and f"resumed at step {n}, so for its last {n} steps" in card


def test_streamed_resume_starts_the_stream_at_its_checkpoint(tmp_path, text_file):
    """A streamed run resumed from checkpoint-N goes on from the stream position saved with it (Trainer would read
    and tokenise again every block consumed before it) and logs the uninterrupted run's losses, with gradient
    accumulation and under DDP (where one process reads the stream for both: 2 steps x 2 x 2 x 2 blocks)."""
    n = 2
    launcher = [shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun"),
                "--standalone", "--nproc_per_node", "2"]
    full, interrupted = tmp_path / "full", tmp_path / "interrupted"
    args = ["--streaming", "--streaming_validation_examples", "200", "--max_steps", str(2 * n), "--save_steps", str(n),
            "--eval_steps", "100", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2"]
    run_train(*tiny(full, text_file, *args), launcher=launcher)
    interrupted.mkdir()
    shutil.copytree(full / f"checkpoint-{n}", interrupted / f"checkpoint-{n}")
    proc = run_train(*tiny(interrupted, text_file, *args), "--resume_from_checkpoint", "true", launcher=launcher)
    assert f"resuming the stream where checkpoint-{n} left it (after {n * 2 * 2 * 2} blocks)" in proc.stdout
    expected, resumed = logged_losses(full), logged_losses(interrupted)
    for step in range(n + 1, 2 * n + 1):
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), step
    # the streamed evaluation (8 blocks; 2 processes x 8 a batch: accelerate repeats rows to fill it) is one process's
    alone = tmp_path / "alone"
    run_train(*tiny(alone, text_file, *args[:-1], "4"))
    losses = [json.loads((d / "all_results.json").read_text())["eval_loss"] for d in (full, alone)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-5)


def test_a_damaged_or_foreign_stream_position_resumes_the_slow_way(tmp_path):
    """A checkpoint's stream position that is cut short, not an object, of another step or of another batch layout
    is not used (the resume reads the stream again, exactly) rather than a traceback or a wrong position."""
    from ddl_tools.streaming import STREAM_POSITION, saved_position

    path = tmp_path / STREAM_POSITION
    assert saved_position(str(tmp_path), 2, 8) is None  # absent
    for text in ("", '{"step": 2, "dr', "[]", '{"step": 3, "drawn": 24, "state": {}}', '{"step": 2, "drawn": 12}',
                 '{"step": 2, "drawn": 16}', '{"step": 2, "drawn": 16, "state": []}'):  # the last two: no state
        path.write_text(text)
        assert saved_position(str(tmp_path), 2, 8) is None, text
    path.write_text('{"step": 2, "drawn": 16, "state": {"epoch": 0}}')
    assert saved_position(str(tmp_path), 2, 8)["state"] == {"epoch": 0}


def test_evaluation_loss_is_the_mean_over_every_token(tmp_path):
    """Trainer's evaluation weighs each batch's mean loss by the full batch size: 12 rows in batches of 8 counted
    the last 4 as 8. Here it is the mean over every evaluated token, rows of different lengths included."""
    from datasets import Dataset
    from transformers import TrainingArguments
    from ddl import DDLForCausalLM
    from ddl_tools.training import DDLTrainer
    from conftest import tiny_config, trained_looking

    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config()), scale=0.3).eval()
    ids = torch.randint(3, 90, (12, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[3, 6:] = -100  # rows with fewer targets weigh less
    rows = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, per_device_eval_batch_size=8, report_to=[])
    got = DDLTrainer(model=model, args=args, eval_dataset=rows).evaluate()["eval_loss"]
    with torch.no_grad():
        expected = model(ids, labels=labels).loss.item()  # one batch: the mean over its targets
    assert got == pytest.approx(expected, rel=1e-6)


def test_the_steady_rate_leaves_out_the_first_steps_evaluations_and_saves(monkeypatch):
    """StepClock counts the intervals between optimizer steps after the first two, except those in which an
    evaluation or a save ran (each interval here lasts its step's number of seconds); a new train() starts again."""
    from ddl_tools import training

    now = [0.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: now[0])
    clock = training.StepClock()
    for _ in range(2):
        clock.on_train_begin(None, None, None)
        for step in range(1, 8):
            now[0] += step  # the interval that ends at this step
            clock.on_step_end(None, None, None)
            if step == 4:
                clock.on_evaluate(None, None, None)  # (after step 4: the interval 4 -> 5 is left out)
            if step == 6:
                clock.on_save(None, None, None)  # (the interval 6 -> 7)
        assert clock.steady() == (3 + 4 + 6, 3)  # the intervals ending at steps 3, 4 and 6
    clock.on_train_begin(None, None, None)
    assert clock.steady() == (0.0, 0)


def test_card_training_time_counts_only_the_steps_this_run_trained():
    from ddl_tools.card import training_time

    fresh = training_time({"train_runtime": 10.0, "device": "cpu"}, tokens_seen=1000, steps=10, world_size=1)
    assert "(100 tokens/s on 1 process(es), cpu)" in fresh
    resumed = training_time({"train_runtime": 10.0, "resumed_at_step": 6}, tokens_seen=1000, steps=10, world_size=1)
    assert "(40 tokens/s " in resumed and "resumed at step 6, so for its last 4 steps" in resumed
    done = training_time({"train_runtime": 1.0, "resumed_at_step": 10}, tokens_seen=1000, steps=10, world_size=1)
    assert "no step left to train" in done and "tokens/s" not in done
    compiled = training_time({"train_runtime": 10.0, "train_steady_seconds": 2.0, "train_steady_steps": 4,
                              "precision": "bf16 mixed precision (float32 weights)", "compiled": True},
                             tokens_seen=1000, steps=10, world_size=1)
    assert compiled.endswith("(100 tokens/s on 1 process(es), unknown device; steady 200 tokens/s over 4 steps, "
                             "without the first two, evaluations and saves); bf16 mixed precision (float32 weights), "
                             "compiled (torch.compile: its compilation is in the time, not in the steady rate).")


def test_from_llama_additive_is_that_llama(llama_dir):
    from transformers import AutoConfig, LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(llama_dir)
    config = ddl_config_from_llama(AutoConfig.from_pretrained(llama_dir), ddl_residual="additive",
                                   ddl_value_channels=1)
    model = load_from_llama(str(llama_dir), config)
    ids = torch.randint(0, llama.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = llama(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    assert torch.equal(got.logits, expected.logits)
    assert got.loss.item() == expected.loss.item()


def test_from_llama_initialises_the_ddl_branches(llama_dir):
    from transformers import AutoConfig, LlamaForCausalLM

    llama = LlamaForCausalLM.from_pretrained(llama_dir)
    config = ddl_config_from_llama(AutoConfig.from_pretrained(llama_dir), ddl_beta_init=0.5)  # d_v=4 CC + EC
    model = load_from_llama(str(llama_dir), config)
    llama_state = llama.state_dict()
    for name, tensor in model.state_dict().items():
        if name in llama_state:
            assert torch.equal(tensor, llama_state[name]), name
    layer = model.model.layers[0]
    assert torch.allclose(layer.attn_delta.beta_bias, torch.tensor([math.log(0.25 / 0.75)]))
    d = config.hidden_size  # the authors' initialisation (the default): spectral scales, neutral compressors
    assert 0 < layer.attn_delta.beta_weight.abs().max() < 5 * 0.5 / d
    assert layer.mlp_delta.value_weight.std().item() == pytest.approx(0.5 * math.sqrt(4) / d, rel=0.3)
    for compress in (layer.compress, model.model.readout):
        assert torch.all(compress.conv_weight == 0.25) and torch.all(compress.read == 0.25)
    taps = model.model.embed_conv.weight
    assert torch.all(taps[-1] == 1) and torch.all(taps[:-1] == 0)


def test_cli_from_llama_additive_gives_the_llama_loss(tmp_path, llama_dir, text_file):
    """Evaluation only (`--do_train false`): the DDL built from the Llama scores the Llama's loss on the same blocks."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path / "from_llama"
    run_train("--init_from_llama", str(llama_dir), "--ddl_residual", "additive", "--ddl_value_channels", "1",
              "--train_file", str(text_file), "--output_dir", str(out), "--do_train", "false", *TINY_RUN)
    got = json.loads((out / "all_results.json").read_text())["eval_loss"]

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    raw, info = load_raw_datasets(train_file=str(text_file))
    raw = ensure_validation_split(raw, 5.0, 42, info["documents"])
    blocks = tokenize_and_pack(raw, tokenizer, "text", 32, info["documents"])["validation"].select(range(8))
    ids = torch.tensor(blocks["input_ids"])
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(llama_dir)(input_ids=ids, labels=ids).loss.item()
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(
    os.path.join(os.path.dirname(sys.executable), "torchrun")), reason="torchrun is not available")
def test_ddp_two_processes(tmp_path, text_file):
    out = tmp_path / "ddp"
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = run_train(*tiny(out, text_file, "--max_steps", "3", "--eval_steps", "3", "--save_steps", "3"),
                     launcher=[torchrun, "--nproc_per_node", "2", "--master_port", "29531"])
    results = json.loads((out / "all_results.json").read_text())
    assert results["tokens_seen"] == 3 * 4 * 32 * 2  # both processes' batches counted
    assert "x 2 blocks of 32 tokens" in (out / "README.md").read_text()
    assert proc.stdout.count("sample from") == 1  # only the main process saves and samples


BAD_INPUTS = {
    "missing-file": (["--train_file", "{tmp}/nope.txt"], "does not exist"),
    "folder-as-file": (["--train_file", "{tmp}"], "is a folder; name one data file"),  # (said "does not exist")
    "empty-file": (["--train_file", "{empty}"], "is empty"),
    "too-little-text": (["--block_size", "900"], "fewer than --block_size"),
    "block-above-context": (["--block_size", "2048"], "max_position_embeddings"),
    "unknown-preset": (["--preset", "huge"], "invalid choice"),
    "bad-residual": (["--ddl_residual", "additve"], "ddl_residual must be one of"),
    "bad-value-channels": (["--ddl_value_channels", "0"], "ddl_value_channels must be"),
    "bad-override": (["--config_overrides", "hiden_size=64"], "not a DDLConfig field"),
    "not-ddl-checkpoint": (["--model_name_or_path", "{llama}"], "--init_from_llama"),
    "non-empty-output": (["--output_dir", "{nonempty}"], "refusing to overwrite"),
    # Trainer reads any max_steps <= 0 as "use --num_train_epochs" (-3 trained 3 epochs)
    "negative-max-steps": (["--max_steps", "-3"], "--max_steps -3: give a positive number"),
    # these were tracebacks (FileExistsError, PermissionError at a save, KeyError)
    "output-is-a-file": (["--output_dir", "{afile}"], "is a file, not a folder"),
    "unwritable-output": (["--output_dir", "/sys/ddl-test-unwritable/run"], "cannot create it"),
    "csv-without-text-column": (["--train_file", "{csv}"], "--text_column 'text' is not a column"),
    # these were tracebacks after the tokenizer was written (DataLoader, ZeroDivisionError, AdamW, TrainingArguments,
    # tokenizers' TypeError on a number, safetensors, a size-mismatch report), or silent (a negative weight decay
    # trained; --block_size 0 meant 256). (--block_size 32: the base command's text is too short for 256.)
    "no-batch": (["--block_size", "32", "--per_device_train_batch_size", "0"],
                 "--per_device_train_batch_size 0: must be at least 1"),
    "no-accumulation": (["--block_size", "32", "--gradient_accumulation_steps", "0"],
                        "--gradient_accumulation_steps 0: must be at least"),
    "negative-learning-rate": (["--block_size", "32", "--learning_rate", "-1"],
                               "--learning_rate -1.0: must be a number >= 0"),
    "negative-weight-decay": (["--block_size", "32", "--weight_decay", "-0.1"],
                              "--weight_decay -0.1: must be a number >= 0"),
    "negative-warmup": (["--warmup_steps", "-1"], "warmup_steps >= 0"),
    "negative-seed": (["--seed", "-1"], "--seed -1: must be in [0, 2**32)"),
    "block-size-0": (["--block_size", "0"], "--block_size must be at least 2"),
    # (found by a user-style test pass: tracebacks after the tokenizer was written)
    "no-eval-samples": (["--max_eval_samples", "0"], "--max_eval_samples must be at least 1"),
    "no-streamed-validation": (["--streaming", "--max_steps", "2", "--streaming_validation_examples", "0"],
                               "--streaming_validation_examples must be at least 1"),
    "streamed-file-all-held-out": (["--streaming", "--max_steps", "2", "--streaming_validation_examples", "5000"],
                                   "no row after the first 5000"),
    "numeric-text-column": (["--train_file", "{numbers}"], "--text_column 'text' of the train data holds int64"),
    "truncated-checkpoint": (["--model_name_or_path", "{truncated}"], "model.safetensors is cut short"),
    "misshapen-checkpoint": (["--model_name_or_path", "{misshapen}"], "its weights do not fit its config.json"),
    "misshapen-resume": (["--output_dir", "{misshapen_run}", "--resume_from_checkpoint", "true"],
                         "its weights do not fit its config.json"),
    # a size-mismatch traceback from from_pretrained, after the tokenizer and data were loaded
    "misshapen-llama": (["--init_from_llama", "{misshapen_llama}"], "its weights do not fit its config.json"),
}


def damaged_checkpoints(tmp_path, text_file) -> dict:
    """A DDL checkpoint whose model.safetensors is cut short (a save stopped by a full disk), one whose config.json
    is not its weights' own (hidden size 64, weights of 32), and a run folder whose checkpoint is the latter."""
    from ddl import DDLForCausalLM
    from ddl_tools.presets import preset_config

    tokenizer = train_bpe_tokenizer([text_file.read_text().splitlines()[:200]], vocab_size=300)
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=16)
    model = DDLForCausalLM(preset_config("tiny", len(tokenizer), sizes))
    truncated, misshapen = tmp_path / "truncated", tmp_path / "misshapen"
    for folder in (truncated, misshapen):
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    config = json.loads((misshapen / "config.json").read_text())
    (misshapen / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    run = tmp_path / "misshapen_run"
    shutil.copytree(misshapen, run / "checkpoint-1")
    (run / "checkpoint-1" / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    return dict(truncated=truncated, misshapen=misshapen, misshapen_run=run)


@pytest.fixture
def bad_input_args(tmp_path, text_file, llama_dir):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "keep.txt").write_text("precious")
    small = tmp_path / "small.txt"
    small.write_text(text_file.read_text()[:3000])
    (tmp_path / "afile").write_text("precious")
    (tmp_path / "data.csv").write_text("body\n" + "\n".join(text_file.read_text().splitlines()[:300]) + "\n")
    (tmp_path / "numbers.csv").write_text("text\n" + "\n".join(str(i) for i in range(300)) + "\n")
    checkpoints = damaged_checkpoints(tmp_path, text_file)
    misshapen_llama = shutil.copytree(llama_dir, tmp_path / "misshapen_llama")  # a config.json of another size
    config = json.loads((misshapen_llama / "config.json").read_text())
    (misshapen_llama / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    fill = dict(tmp=tmp_path, empty=tmp_path / "empty.txt", llama=llama_dir, nonempty=tmp_path / "nonempty",
                afile=tmp_path / "afile", csv=tmp_path / "data.csv", numbers=tmp_path / "numbers.csv",
                misshapen_llama=misshapen_llama, **checkpoints)

    def make(case):
        args, message = BAD_INPUTS[case]
        base = ["--train_file", str(small), "--output_dir", str(tmp_path / "out"), "--report_to", "none",
                "--use_cpu", "--max_steps", "1", "--vocab_size", "300"]
        return base + [a.format(**fill) for a in args], message  # later flags win

    yield make
    assert (tmp_path / "nonempty" / "keep.txt").read_text() == "precious"
    assert (tmp_path / "afile").read_text() == "precious"


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_rejected_clearly(case, bad_input_args, capsys):
    """In process (an interpreter start costs seconds): `train.cli` is what `python train.py` runs."""
    import train

    args, message = bad_input_args(case)
    status, err = run_script_cli(train.cli, args, capsys)
    assert status == 2
    assert message in err and "error:" in err, err[-3000:]
    assert "Traceback" not in err


def test_bad_input_exits_non_zero_without_traceback(bad_input_args):
    """The same through a real `python train.py` process: exit status 2, one message, no traceback."""
    args, message = bad_input_args("bad-residual")
    proc = run_train(*args, check=False)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]


# -------------------------------------------------------------------------------- never lose a user's work


def run_cli(args, capsys):
    """`python train.py args` in this process (an interpreter start costs seconds): status, stderr."""
    import train

    return run_script_cli(train.cli, [str(a) for a in args], capsys)


def copy_run(trained, dest, checkpoints=True):
    out, _ = trained
    shutil.copytree(out, dest, ignore=None if checkpoints else shutil.ignore_patterns("checkpoint-*"))
    return dest


def test_resuming_into_another_runs_folder_is_refused(trained, tmp_path, text_file, capsys):
    """--resume_from_checkpoint OTHER/checkpoint-N --output_dir EXISTING used to replace EXISTING's weights, config,
    tokenizer and card without --overwrite_output_dir."""
    existing = copy_run(trained, tmp_path / "existing", checkpoints=False)
    before = {p.name: p.read_bytes() for p in existing.iterdir() if p.is_file()}
    other = trained[0] / "checkpoint-3"
    status, err = run_cli(tiny(existing, text_file, "--max_steps", "3", "--resume_from_checkpoint", other), capsys)
    assert status == 2 and "is not empty; resuming" in err and "--overwrite_output_dir" in err, err[-2000:]
    assert {p.name: p.read_bytes() for p in existing.iterdir() if p.is_file()} == before


def test_resumed_run_survives_checkpoint_rotation(trained, tmp_path, text_file, capsys):
    """With the default save_total_limit (2) the resumed checkpoint is rotated away during training; the run used to
    crash at the very end rereading its trainer_state.json (no final model, metrics or card)."""
    interrupted = tmp_path / "interrupted"
    interrupted.mkdir()
    shutil.copytree(trained[0] / "checkpoint-3", interrupted / "checkpoint-3")
    # a resumed run keeps its checkpoint's save_steps (3): saves at 6 and 9 rotate checkpoint-3 away
    status, err = run_cli(tiny(interrupted, text_file, "--max_steps", "9", "--eval_steps", "100",
                               "--resume_from_checkpoint", "true"), capsys)
    assert status == 0, err[-3000:]
    assert not (interrupted / "checkpoint-3").exists()  # rotated away, as the case needs
    results = json.loads((interrupted / "all_results.json").read_text())
    assert results["resumed_at_step"] == 3 and (interrupted / "README.md").is_file()
    assert not (interrupted / ".ddl_unfinished_run.json").exists()  # a finished run


def test_resuming_a_finished_run_trains_no_step_past_max_steps(trained, tmp_path, text_file, capsys):
    """Resuming from the last checkpoint of a finished run used to train step max_steps + 1 (the card counted it)."""
    finished = copy_run(trained, tmp_path / "finished")
    status, err = run_cli(tiny(finished, text_file, "--max_steps", "3", "--resume_from_checkpoint", "true"), capsys)
    assert status == 0, err[-3000:]
    assert json.loads((finished / "trainer_state.json").read_text())["global_step"] == 3
    assert "Tokens seen: 384 in 3 optimizer steps" in (finished / "README.md").read_text()
    assert json.loads((finished / "all_results.json").read_text())["resumed_at_step"] == 3


@pytest.mark.parametrize("flags, message", [
    (["--ddl_residual", "additive"], "its model has ddl_residual = 'additive' (it has 'delta')"),
    (["--config_overrides", "hidden_size=64"], "its model has hidden_size = 64 (it has 32)"),
    (["--block_size", "64"], "--block_size 64 is not the checkpoint's 32 (the data would be re-packed"),
], ids=["ddl-flag", "override", "block-size"])
def test_resuming_refuses_a_changed_model_or_block_size(flags, message, trained, tmp_path, text_file, capsys):
    """The checkpoint's config used to win silently over changed --ddl_* flags, and a new --block_size re-packed the
    data under the resumed position."""
    folder = copy_run(trained, tmp_path / "run")
    before = sorted(os.listdir(folder))  # (a finished run: no unfinished-run mark)
    args = ["--train_file", text_file, "--output_dir", folder, *TINY_RUN, "--max_steps", "6"]
    status, err = run_cli([*args, *flags, "--resume_from_checkpoint", "true"], capsys)
    assert status == 2 and message in err, err[-2000:]
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 3  # untouched
    assert sorted(os.listdir(folder)) == before  # (nothing written: not even the mark)


def resume_in_process(checkpoint, argv):
    """train.py's resume of `checkpoint` with `argv`, in process, up to its comparison of the two runs' records:
    the data and training arguments it would train with."""
    import train
    from transformers import AutoTokenizer

    from ddl_tools import resume

    model_args, data_args, training_args = train.parse_args(argv)
    _, recorded = train.resume_from(checkpoint, model_args, data_args, training_args, argv)
    now = resume.run_record(data_args, training_args, "validation_split_percentage",
                            AutoTokenizer.from_pretrained(checkpoint))
    now["model"] = {**recorded["model"], **model_args.shaping()}
    resume.check_continues(checkpoint, recorded, now, "the checkpoint's")
    return data_args, training_args


def test_resume_accepts_the_same_flags_and_keeps_the_block_size(trained):
    checkpoint = str(trained[0] / "checkpoint-3")
    argv = ["--ddl_value_channels", "4", "--ddl_residual", "delta", "--config_overrides", TINY_MODEL]
    data_args, _ = resume_in_process(checkpoint, argv)
    assert data_args.block_size == 32  # the checkpoint's, not the preset's default 256


@pytest.mark.parametrize("flags, message", [
    (["--learning_rate", "1e-2"], "--learning_rate 0.01 is not the checkpoint's 0.001 (Trainer restores the "
                                  "schedule's peak from the checkpoint: the flag would be ignored)"),
    (["--weight_decay", "0.5", "--adam_beta2", "0.99"], "--adam_beta2 0.99 is not the checkpoint's 0.95"),
    (["--optim", "sgd"], "--optim sgd is not the checkpoint's adamw_torch"),
    (["--per_device_train_batch_size", "8"], "--per_device_train_batch_size 8 is not the checkpoint's 4"),
    (["--seed", "7"], "--seed 7 is not the checkpoint's 42"),
], ids=["learning-rate", "optimizer-settings", "optimizer", "batch", "seed"])
def test_resuming_refuses_training_arguments_it_would_not_honour(flags, message, trained, tmp_path, text_file,
                                                                  capsys):
    """Trainer restores the optimizer, with its settings and the schedule's peak, from the checkpoint: a resume with
    --learning_rate 1e-2 trained on at the checkpoint's rate with exit 0 and no word (as did another weight decay or
    Adam beta), another --optim was a KeyError traceback, and another batch or seed resumed at other blocks than the
    run's next ones."""
    folder = copy_run(trained, tmp_path / "run")
    before = sorted(os.listdir(folder))  # (a finished run: no unfinished-run mark)
    args = ["--train_file", text_file, "--output_dir", folder, *TINY_RUN, "--max_steps", "6"]
    status, err = run_cli([*args, *flags, "--resume_from_checkpoint", "true"], capsys)
    assert status == 2 and message in err and "Traceback" not in err, err[-2000:]
    assert "to resume, or start a new run in another --output_dir to train with" in err
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 3  # untouched
    assert sorted(os.listdir(folder)) == before  # (nothing written: not even the mark)


def test_a_resume_without_max_steps_keeps_the_runs_length(trained):
    """The README's resume command gives no --max_steps: the run's length was the preset's (500 steps; a checkpoint
    past it was declared finished), not the checkpoint's (found by a user-style test pass). Now it is the run's."""
    import train

    checkpoint = str(trained[0] / "checkpoint-3")
    assert train.parse_args(["--config_overrides", TINY_MODEL])[2].max_steps == 500
    _, training_args = resume_in_process(checkpoint, ["--config_overrides", TINY_MODEL])
    assert (training_args.max_steps, training_args.num_train_epochs) == (3, 3.0)
    argv = ["--config_overrides", TINY_MODEL, "--max_steps", "-1", "--num_train_epochs", "2"]  # (given: followed)
    _, training_args = resume_in_process(checkpoint, argv)
    assert (training_args.max_steps, training_args.num_train_epochs) == (-1, 2.0)


def test_a_resume_holds_out_its_runs_validation_rows(trained):
    """Another --validation_split_percentage on resume moved rows between training and validation under the
    checkpoint's data position, silently (found by a user-style test pass): refused. The flag that did not choose the
    rows is not compared (it was refused), and a record in ddl 0.3.0's layout is read as today's."""
    from ddl_tools.outputs import UsageError
    from ddl_tools.resume import DDLRunRecord

    checkpoint = str(trained[0] / "checkpoint-3")
    with pytest.raises(UsageError, match="--validation_split_percentage 30 is not the checkpoint's 5 .*move rows"):
        resume_in_process(checkpoint, ["--config_overrides", TINY_MODEL, "--validation_split_percentage", "30"])
    resume_in_process(checkpoint, ["--config_overrides", TINY_MODEL, "--streaming_validation_examples", "7"])
    earlier = DDLRunRecord(block_size=32, tokenizer="t", training={"seed": 42}, data={
        "name": "corpus.txt", "text_column": "text", "split": {"validation_split_percentage": 5.0},
        "files": {"train": {"file": "corpus.txt", "sha256": "s"}}})
    assert earlier.record == {"seed": 42, "validation_split_percentage": 5.0, "block_size": 32, "text_column": "text",
                              "tokenizer": "t", "train_file": {"file": "corpus.txt", "sha256": "s"}}


def test_a_resume_keeps_the_checkpoints_training_arguments_and_follows_the_schedule_given(trained):
    """What the command line does not give is the checkpoint's (here its batch of 4, not the preset's 16: the run
    resumes at its next block, and its card says what it trained with); what Trainer builds from the command line on
    resume (the schedule's shape and length, the clipping) is taken as given, in any spelling, and so is a flag that
    repeats the checkpoint's value. A flag Trainer would ignore is refused however it is spelt."""
    import train
    from ddl_tools.outputs import UsageError

    checkpoint = str(trained[0] / "checkpoint-3")
    argv = ["--config_overrides", TINY_MODEL, "--learning-rate", "1e-3", "--max_grad_norm=0.5", "--warmup_steps", "2",
            "--lr_scheduler_type", "linear", "--optim", "adamw_torch", "--max_steps", "9"]
    assert train.parse_args(argv)[2].per_device_train_batch_size == 16
    _, training_args = resume_in_process(checkpoint, argv)
    assert training_args.per_device_train_batch_size == 4 and training_args.learning_rate == 1e-3
    assert (training_args.max_grad_norm, training_args.warmup_steps, training_args.max_steps) == (0.5, 2, 9)
    assert training_args.lr_scheduler_type == "linear" and training_args.optim == "adamw_torch"
    with pytest.raises(UsageError, match="--learning_rate 0.01 is not the checkpoint's 0.001"):
        resume_in_process(checkpoint, ["--config_overrides", TINY_MODEL, "--learning-r=1e-2"])


def test_the_documented_resume_command_continues_a_run_on_its_own_file(trained, tmp_path, capsys):
    """The README's resume command, `--output_dir DIR --resume_from_checkpoint true` and nothing more, was refused
    for every run on its own --train_file ("the data is 'shakespeare ...', the run's was 'corpus.txt'"): the data file
    was the one setting not taken from the checkpoint. The run's record names it, and its content is checked."""
    folder = copy_run(trained, tmp_path / "run")
    for name in ("model.safetensors", "README.md", "all_results.json"):  # as if stopped in its final save
        (folder / name).unlink()
    status, err = run_cli(["--output_dir", folder, "--resume_from_checkpoint", "true"], capsys)
    assert status == 0, err[-3000:]
    assert "- Data: corpus.txt;" in (folder / "README.md").read_text()
    assert json.loads((folder / "all_results.json").read_text())["resumed_at_step"] == 3


def test_a_failed_run_does_not_block_its_corrected_rerun(tmp_path, text_file, capsys):
    """A run that fails after training its tokenizer leaves it in the output folder; the corrected rerun used to be
    refused ('exists and is not empty')."""
    out, short = tmp_path / "out", tmp_path / "short.txt"
    short.write_text("Too short\nfor one block.\n")
    status, err = run_cli(tiny(out, short, "--max_steps", "1"), capsys)
    assert status == 2 and "packing left nothing to train on" in err, err[-2000:]
    assert (out / "tokenizer.json").is_file()  # what the failed run left
    status, err = run_cli(tiny(out, text_file, "--max_steps", "1", "--eval_steps", "1", "--save_steps", "1"), capsys)
    assert status == 0, err[-3000:]
    assert (out / "model.safetensors").is_file()


def test_a_second_run_into_a_folder_being_written_is_refused(tmp_path, text_file, capsys):
    """While a run writes its (still empty) output folder, another run into it stops with one line naming the
    writer (it used to start writing there too), and leaves it as it was."""
    from ddl_tools.outputs import FolderLock

    out = tmp_path / "out"
    out.mkdir()
    lock = FolderLock(str(out))  # another open file: flock treats it as another writer, as another process
    assert lock.acquire()
    try:
        status, err = run_cli(tiny(out, text_file, "--max_steps", "1"), capsys)
        assert status == 2 and f"is being written by another run (pid {os.getpid()})" in err, err[-2000:]
        assert os.listdir(out) == [".ddl.lock"]
    finally:
        lock.release()


def resolve_in(out, resume=None):
    """`train.py --output_dir OUT [--resume_from_checkpoint RESUME]`'s claim of its folder and choice of checkpoint,
    in process, the folder let go of afterwards."""
    import train
    from ddl_tools import runs

    argv = ["--output_dir", str(out), "--use_cpu", "--report_to", "none"]
    args = train.parse_args(argv + (["--resume_from_checkpoint", resume] if resume else []))[2]
    try:
        return runs.claim_output_dir(args.output_dir, args.resume_from_checkpoint, args.overwrite_output_dir,
                                     args.do_train)
    finally:
        runs.release_output_dirs()



def test_resume_skips_and_names_an_incomplete_checkpoint(tmp_path, caplog):
    """A kill during a checkpoint save leaves a folder without trainer_state.json: `true` resumes from the newest
    complete checkpoint and says so; naming the incomplete one points to it. (Both used to fail with 'not a Trainer
    checkpoint folder'.)"""
    from ddl_tools.outputs import UsageError

    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (out / "checkpoint-4").mkdir()
    (out / "checkpoint-4" / "model.safetensors").write_bytes(b"half")

    with caplog.at_level("WARNING"):
        assert resolve_in(out, "true") == str(out / "checkpoint-2")
    assert "checkpoint-4 is incomplete" in caplog.text
    newest = r"checkpoint-4' is incomplete .* newest complete checkpoint there is .*checkpoint-2"
    with pytest.raises(UsageError, match=newest):
        resolve_in(out, str(out / "checkpoint-4"))


def test_card_says_the_remote_code_is_pytorch_and_where_the_kernels_come_from(monkeypatch):
    """The card tells a Hub user what loading runs (PyTorch only; tests/test_remote_code.py shows it) and that the
    faster kernels are the optional ddl_kernels package, with the real switch (DDL_IMPLEMENTATION=torch)."""
    from ddl.ops import choose
    from ddl_tools.card import MODEL_CARD

    monkeypatch.setenv("DDL_IMPLEMENTATION", "torch")
    assert choose(None) == "torch"  # the switch named is the code's
    assert "PyTorch only" in MODEL_CARD and "start no process" in MODEL_CARD
    assert "ddl_kernels" in MODEL_CARD and "DDL_IMPLEMENTATION=torch" in MODEL_CARD
    assert "compiler" not in MODEL_CARD


def test_ctrl_c_says_what_to_do(trained, tmp_path, text_file, capsys, monkeypatch):
    """Ctrl-C is one line (not a traceback) that says whether to resume or to rerun."""
    import train

    def interrupt(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "build_kernels", interrupt)
    status, err = run_cli(tiny(tmp_path / "fresh", text_file, "--max_steps", "1"), capsys)
    assert status == 130 and "no checkpoint was saved yet" in err and "Traceback" not in err
    folder = copy_run(trained, tmp_path / "run")
    status, err = run_cli(tiny(folder, text_file, "--max_steps", "6", "--resume_from_checkpoint", "true"), capsys)
    assert status == 130 and "plus --resume_from_checkpoint true" in err and "checkpoint-3" in err


# ------------------------------------------------- never a wrong number, never a lost file, never code run unasked


def damage(path, how):
    data = path.read_bytes()
    path.write_bytes(b"" if how == "empty" else data[: len(data) // 2])


@pytest.mark.parametrize("name", ["trainer_state.json", "model.safetensors", "optimizer.pt"])
@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_resume_skips_and_names_a_damaged_checkpoint(name, how, trained, tmp_path, caplog):
    """A full disk or a power loss while saving checkpoint-6 leaves a 0-byte or truncated file beside a state that
    exists: only the state's existence was checked, so every `--resume_from_checkpoint true` took checkpoint-6 and
    failed with a JSONDecodeError (or safetensors / torch) traceback, although checkpoint-3 was intact."""
    from ddl_tools.outputs import UsageError

    out = tmp_path / "run"
    for step in (3, 6):
        shutil.copytree(trained[0] / "checkpoint-3", out / f"checkpoint-{step}")
    damage(out / "checkpoint-6" / name, how)
    with caplog.at_level("WARNING"):
        assert resolve_in(out, "true") == str(out / "checkpoint-3")
    assert f"checkpoint-6 is damaged (its {name} " in caplog.text
    with pytest.raises(UsageError, match=r"checkpoint-6' is damaged .* newest complete checkpoint there is "
                                                  r".*checkpoint-3"):
        resolve_in(out, str(out / "checkpoint-6"))


def test_a_full_disk_at_a_checkpoint_is_one_line_and_the_resume_skips_it(tmp_path, text_file, capsys, caplog,
                                                                           monkeypatch):
    """The disk fills up while checkpoint-4's trainer_state.json is written (a 0-byte file is left, as a real full
    disk leaves it): one line that names the folder and says how to continue, not a traceback; the folder stays
    resumable, and the resume continues from checkpoint-2, naming the damaged checkpoint-4."""
    import errno

    from transformers import TrainerState

    save = TrainerState.save_to_json

    def full_disk(self, path):
        if f"checkpoint-4{os.sep}" in path:
            open(path, "w").close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return save(self, path)

    out = tmp_path / "run"
    args = tiny(out, text_file, "--max_steps", "4", "--save_steps", "2", "--eval_steps", "100")
    monkeypatch.setattr(TrainerState, "save_to_json", full_disk)
    status, err = run_cli(args, capsys)
    assert status == 2 and "Traceback" not in err, err[-3000:]
    line = next(line for line in err.splitlines() if "error:" in line)
    assert f"saving checkpoint-4 into {str(out)!r} failed ([Errno 28] No space left on device" in line
    assert "plus --resume_from_checkpoint true" in line and "checkpoint-2" in line
    assert (out / "checkpoint-4" / "trainer_state.json").stat().st_size == 0
    assert (out / ".ddl_unfinished_run.json").is_file() and not (out / "all_results.json").exists()
    monkeypatch.setattr(TrainerState, "save_to_json", save)
    with caplog.at_level("WARNING"):
        status, err = run_cli([*args, "--resume_from_checkpoint", "true"], capsys)
    assert status == 0, err[-3000:]
    assert "Resuming from checkpoint-2" in caplog.text and "checkpoint-4 is damaged (its trainer_state.json is empty" \
        in caplog.text
    assert json.loads((out / "all_results.json").read_text())["resumed_at_step"] == 2


def test_a_diverging_run_stops_at_that_step_and_keeps_the_last_good_checkpoint(tmp_path, text_file, capsys):
    """--learning_rate 1e6: the gradient norm turns NaN within a few steps. Trainer's NaN filter logged `loss 0`, the
    NaN model was saved as final with all_results.json saying `final_train_loss: 0.0`, and the run only failed at
    the sample (a traceback). Now it stops at that step with one line, saves nothing of it, and keeps the folder
    resumable with its last good checkpoint."""
    import re

    from safetensors.torch import load_file

    from ddl_tools.runs import last_complete_checkpoint

    out = tmp_path / "run"
    status, err = run_cli(tiny(out, text_file, "--max_steps", "12", "--save_steps", "2", "--eval_steps", "100",
                               "--learning_rate", "1e6"), capsys)
    assert status == 2 and "Traceback" not in err, err[-3000:]
    found = re.search(r"train.py: error: training diverged at step (\d+): the (gradient norm is (nan|inf)|loss is not "
                      r"finite)", err)
    assert found, err[-2000:]
    step = int(found[1])
    assert "Lower --learning_rate (the run's peak is 1e+06)" in err
    for name in ("all_results.json", "README.md", "model.safetensors", "loss_curve.png"):
        assert not (out / name).exists(), name  # no final model, no results or card claiming success
    assert (out / ".ddl_unfinished_run.json").is_file()  # resumable, or rerun with --overwrite_output_dir
    latest = last_complete_checkpoint(str(out))
    assert latest is not None and f"{os.path.basename(latest)}, is kept" in err
    saved = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert saved and max(saved) < step
    weights = load_file(os.path.join(latest, "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_resume_refuses_a_data_file_replaced_on_disk(trained, tmp_path, text_file, capsys):
    """The run's data file is replaced between the run and its resume (same name, other text): the resume used to
    continue on the new text with exit 0 and no word. Restored, the same resume goes through."""
    folder = copy_run(trained, tmp_path / "run")
    before = sorted(os.listdir(folder))  # (a finished run: no unfinished-run mark)
    data = tmp_path / text_file.name  # the file the run read, moved: its content is what counts
    data.write_text(text_file.read_text().replace("king", "queen"))
    args = ["--train_file", data, "--output_dir", folder, *TINY_RUN, "--max_steps", "4", "--resume_from_checkpoint",
            "true"]
    status, err = run_cli(args, capsys)
    assert status == 2 and f"{text_file.name!r} has changed since the run read it" in err, err[-2000:]
    assert "start a new run in another --output_dir" in err
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 3  # untouched
    assert sorted(os.listdir(folder)) == before  # (nothing written: not even the mark)
    data.write_text(text_file.read_text())
    status, err = run_cli(args, capsys)
    assert status == 0, err[-3000:]
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.parametrize("change", ["another-train-file", "another-tokenizer"])
def test_resume_refuses_other_data_or_another_tokenizer(change, trained, tmp_path, text_file, capsys):
    """Resuming with another --train_file, or another --tokenizer_name of the same vocabulary size (other merges),
    used to continue with exit 0 and no word; the folder then shipped a tokenizer the first part never used."""
    folder = copy_run(trained, tmp_path / "run")
    before = sorted(os.listdir(folder))  # (a finished run: no unfinished-run mark)
    args = ["--output_dir", folder, *TINY_RUN, "--max_steps", "4", "--resume_from_checkpoint", "true"]
    if change == "another-train-file":
        other = tmp_path / "other.txt"
        other.write_text("\n".join(reversed(text_file.read_text().splitlines())) + "\n")
        args += ["--train_file", other]
        message = "--train_file 'other.txt' is not the file the run read ('corpus.txt')"
    else:
        words = " ".join(reversed(WORDS))
        tokenizer = train_bpe_tokenizer([[f"{words} {w}." for w in WORDS] * 20], vocab_size=300)
        assert len(tokenizer) == json.loads((folder / "config.json").read_text())["vocab_size"]
        tokenizer.save_pretrained(tmp_path / "tokenizer")
        args += ["--train_file", text_file, "--tokenizer_name", tmp_path / "tokenizer"]
        message = "the tokenizer (" + str(tmp_path / "tokenizer") + ") is not the one it was trained with"
    status, err = run_cli(args, capsys)
    assert status == 2 and message in err and "Traceback" not in err, err[-2000:]
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 3  # untouched
    assert sorted(os.listdir(folder)) == before  # (nothing written: not even the mark)


def test_a_checkpoint_without_the_data_record_resumes_with_a_warning(trained, tmp_path, text_file, capsys, caplog):
    """A checkpoint saved before train.py recorded its data and tokenizer has nothing to compare with: it resumes,
    and says that it could not check them."""
    folder = copy_run(trained, tmp_path / "run")
    state_file = folder / "checkpoint-3" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["stateful_callbacks"]["DDLRunRecord"]["args"] = {"block_size": 32}  # what earlier versions saved
    state_file.write_text(json.dumps(state))
    with caplog.at_level("WARNING"):
        status, err = run_cli(["--train_file", text_file, "--output_dir", folder, *TINY_RUN, "--max_steps", "4",
                               "--resume_from_checkpoint", "true"], capsys)
    assert status == 0, err[-3000:]
    assert "does not record its data, tokenizer, training arguments" in caplog.text
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.parametrize("leftovers", [[".ddl_unfinished_run.json.tmp"],
                                       [".ddl_unfinished_run.json", ".ddl_unfinished_run.json.ddl-tmp"]],
                         ids=["old-temporary-name", "mark-and-temporary-file"])
def test_a_write_cut_short_does_not_block_the_folder(leftovers, tmp_path):
    """A kill or a full disk while the unfinished-run mark is written leaves its temporary file: alone in the folder it
    was taken for a user's file ("exists and is not empty"); beside the mark it was kept forever. The next claim of
    the folder deletes it and starts over there."""
    out = tmp_path / "run"
    out.mkdir()
    for name in leftovers:  # the mark whole (an earlier run's), the temporary files cut short
        whole = name == ".ddl_unfinished_run.json"
        (out / name).write_text('{"command": ["train.py"], "started": "then"}' if whole else '{"command": ["tr')
    from ddl_tools.runs import take_output_dir

    assert resolve_in(out) is None  # no checkpoint to resume: a fresh start, not a refusal
    assert sorted(p.name for p in out.iterdir()) == ([".ddl_unfinished_run.json"] if len(leftovers) > 1 else [])
    take_output_dir(str(out), overwrite=False, resume=None)  # (once the run's checks have passed)
    assert sorted(p.name for p in out.iterdir()) == [".ddl_unfinished_run.json"]
    assert json.loads((out / ".ddl_unfinished_run.json").read_text())["command"]  # a mark, whole


@pytest.mark.parametrize("variable", ["DDL_IMPLEMENTATION", "DDL_CPU_KERNEL"])
def test_an_invalid_ddl_environment_variable_is_refused_before_anything_is_written(variable, tmp_path, text_file,
                                                                                  capsys, monkeypatch):
    """It used to be a ValueError traceback at the model's first use, after the tokenizer was written."""
    monkeypatch.setenv(variable, "fastest")
    status, err = run_cli(tiny(tmp_path / "out", text_file, "--max_steps", "1"), capsys)
    assert status == 2 and f"{variable}='fastest'" in err and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "out").exists()


def test_rows_without_text_are_skipped_with_a_warning(tmp_path, text_file, capsys, caplog):
    """A JSON-lines file with `"text": null` rows (a broken export) crashed tokenisation with a TypeError traceback.
    They hold no text: they are skipped, and a warning says how many and where the first is."""
    rows = [{"text": line} for line in text_file.read_text().splitlines()[:600]]
    rows[6]["text"] = rows[40]["text"] = None
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    with caplog.at_level("WARNING"):
        status, err = run_cli(tiny(out, data, "--max_steps", "1", "--eval_steps", "1", "--save_steps", "1"), capsys)
    assert status == 0, err[-3000:]
    assert "2 of the 600 rows of the train data have no text (null in column 'text'; the first is row 7)" \
        in caplog.text
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize("bad", [
    ["--ddl_compressor", "bogus"], ["--train_file", "missing.txt"], ["--block_size", "100000"],
    ["--tokenizer_name", "{tmp}/no-tokenizer"], ["--model_name_or_path", "{base}"], ["--vocab_size", "100"],
    ["--tokenizer_name", "{base}", "--train_file", "{tmp}/short.txt"],
    ["--streaming", "--tokenizer_name", "{base}", "--train_file", "{tmp}/numbers.csv"],
], ids=["flag", "data", "block-size", "tokenizer", "checkpoint-with-overrides", "vocab-size", "short-text",
        "streamed-numbers"])
def test_overwrite_with_bad_input_leaves_the_folder_as_it_was(bad, trained, tmp_path, text_file, capsys):
    """--overwrite_output_dir with a bad flag or file: one line, but the old checkpoints were already deleted and the
    folder marked unfinished, so the next plain run replaced the finished model without --overwrite_output_dir (found
    by a user-style test pass). Nothing is deleted or marked until every check has passed, those that need the
    tokenizer or the model too (a block size over the model's context, a tokenizer that does not load, and
    --config_overrides with a checkpoint, a --vocab_size too small for the tokenizer it trains, and with a given
    tokenizer, text too short for one block or a streamed column of numbers, came after the folder was taken)."""
    (tmp_path / "short.txt").write_text("Too short\nfor one block.\n")
    (tmp_path / "numbers.csv").write_text("text\n" + "".join(f"{i}\n" for i in range(3000)))
    finished = copy_run(trained, tmp_path / "finished")
    before = sorted(p.name for p in finished.iterdir())
    bad = [arg.format(tmp=tmp_path, base=trained[0]) for arg in bad]
    status, err = run_cli(tiny(finished, text_file, "--max_steps", "3", "--overwrite_output_dir", *bad), capsys)
    lines = err.strip().splitlines()  # (the data's progress bars come first where the text was tokenised)
    assert status == 2 and lines[-1].startswith("train.py: error: ") and "Traceback" not in err, err[-2000:]
    assert sorted(p.name for p in finished.iterdir()) == before
    status, err = run_cli(tiny(finished, text_file, "--max_steps", "3"), capsys)
    assert status == 2 and "refusing to overwrite it" in err, err[-2000:]


def test_a_run_resumed_at_its_end_finishes_with_its_best_checkpoint(tmp_path, text_file, capsys):
    """--load_best_model_at_end: a run stopped after its last checkpoint (Ctrl-C in the final evaluation or save) and
    resumed shipped the last checkpoint's weights, not the best one's, which Trainer loads at the end of training.
    Here the "best" is the worst loss (greater is better), so the two differ."""
    from safetensors.torch import load_file

    out = tmp_path / "best"
    flags = ("--max_steps", "4", "--save_steps", "2", "--eval_steps", "2", "--learning_rate", "1e-2",
             "--load_best_model_at_end", "true", "--metric_for_best_model", "loss", "--greater_is_better", "true")
    status, err = run_cli(tiny(out, text_file, *flags), capsys)
    assert status == 0, err[-3000:]
    for name in ("model.safetensors", "all_results.json", "README.md"):  # as if stopped before the final save
        (out / name).unlink()
    status, err = run_cli(tiny(out, text_file, *flags, "--resume_from_checkpoint", "true"), capsys)
    assert status == 0, err[-3000:]
    best = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert best.endswith("checkpoint-2")
    saved, expected, last = (load_file(str(path / "model.safetensors"))
                             for path in (out, out / "checkpoint-2", out / "checkpoint-4"))
    assert not all(torch.equal(expected[k], last[k]) for k in expected)
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


def test_a_run_resumed_at_its_end_finds_a_best_checkpoint_in_the_run_it_resumed(tmp_path, text_file, capsys):
    """A run started from another run's checkpoint whose best checkpoint is still that one (in the other folder),
    resumed at its end, was refused: its best was looked for only next to its own checkpoints."""
    from safetensors.torch import load_file

    a, b = tmp_path / "a", tmp_path / "b"
    flags = ("--save_steps", "2", "--eval_steps", "2", "--learning_rate", "1e-2", "--load_best_model_at_end", "true",
             "--metric_for_best_model", "loss", "--greater_is_better", "true")
    assert run_cli(tiny(a, text_file, "--max_steps", "2", *flags), capsys)[0] == 0
    status, err = run_cli(tiny(b, text_file, "--max_steps", "4", *flags, "--resume_from_checkpoint",
                               a / "checkpoint-2"), capsys)
    assert status == 0, err[-3000:]
    best = json.loads((b / "checkpoint-4" / "trainer_state.json").read_text())["best_model_checkpoint"]
    assert os.path.samefile(best, a / "checkpoint-2")  # (the worst loss is the best here)
    for name in ("model.safetensors", "README.md"):  # as if stopped before the final save
        (b / name).unlink()
    status, err = run_cli(tiny(b, text_file, "--max_steps", "4", *flags, "--resume_from_checkpoint", "true"), capsys)
    assert status == 0, err[-3000:]
    saved, expected = (load_file(str(path / "model.safetensors")) for path in (b, a / "checkpoint-2"))
    assert all(torch.equal(saved[k], expected[k]) for k in expected)


def test_load_best_model_at_end_reports_the_saved_models_loss(tmp_path, text_file, capsys):
    """--load_best_model_at_end saves the best checkpoint's weights, but the reported validation loss (all_results,
    the card) was the last step's (found by a user-style test pass). Here the "best" is the worst loss (greater is
    better), so the two differ: the reported loss is the saved model's."""
    out = tmp_path / "best"
    status, err = run_cli(tiny(out, text_file, "--max_steps", "4", "--save_steps", "2", "--eval_steps", "2",
                               "--learning_rate", "1e-2", "--load_best_model_at_end", "true",
                               "--metric_for_best_model", "loss", "--greater_is_better", "true"), capsys)
    assert status == 0, err[-3000:]
    state = json.loads((out / "trainer_state.json").read_text())
    evals = {}
    for entry in (e for e in state["log_history"] if "eval_loss" in e):  # (the final evaluation comes last)
        evals.setdefault(entry["step"], entry["eval_loss"])
    best = int(state["best_model_checkpoint"].rsplit("-", 1)[1])
    assert best != state["global_step"] and evals[best] != evals[state["global_step"]]
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] == pytest.approx(evals[best], rel=1e-5)


def test_a_streamed_column_of_numbers_is_found_past_rows_without_text():
    """A streamed split without declared types is checked on its first rows with a value before the output folder is
    taken; one that began with a null row was found only while training."""
    from datasets import IterableDataset, IterableDatasetDict

    from ddl_tools.data import check_text_column
    from ddl_tools.outputs import UsageError

    def rows():
        yield {"text": None}
        yield {"text": 5}

    with pytest.raises(UsageError, match=r"--text_column 'text' holds a int \(5\), not text"):
        check_text_column(IterableDatasetDict({"train": IterableDataset.from_generator(rows)}), "text")
