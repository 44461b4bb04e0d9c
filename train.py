"""Pretrain or fine-tune a Deep Delta Learning (DDL) language model, or one of its baselines, with 🤗 Trainer.

Zero arguments train a tiny DDL (d_v = 4, CC compressor, EC: the paper's default variant) on the embedded
Shakespeare corpus in about 5 minutes on 2 idle CPU cores, save a complete checkpoint folder (weights, config with
auto_map, the model's .py files, tokenizer, generation config, trainer_state.json, model card with loss curve) and
print a sample generated from that folder:

    python train.py

The paper's controls are one flag away (same everything else):

    python train.py --ddl_residual additive --ddl_value_channels 1   # baseline: the plain (Llama) residual
    python train.py --ddl_value_channels 1                           # DDL d_v=1
    python train.py --ddl_residual write_only                        # write-only control (no erase term)
    python train.py --ddl_compressor tc --ddl_embed_conv false       # DDL-TC w/o EC

Your own text, a 🤗 dataset, or a pretrained tokenizer:

    python train.py --train_file corpus.txt --output_dir outputs/my-ddl            # txt/json/jsonl/csv
    python train.py --dataset_name wikitext --dataset_config_name wikitext-103-raw-v1 --tokenizer_name gpt2
    python train.py --dataset_name HuggingFaceFW/fineweb-edu --dataset_config_name sample-10BT --streaming \\
        --tokenizer_name gpt2 --preset small --max_steps 100000 --output_dir outputs/ddl-small

Fine-tune a DDL checkpoint, or build DDL from a Llama checkpoint (shared weights loaded by name, DDL branches
freshly initialised; with `--ddl_residual additive --ddl_value_channels 1` it is that Llama exactly):

    python train.py --model_name_or_path outputs/ddl-tiny-shakespeare --train_file my.txt --learning_rate 1e-4
    python train.py --init_from_llama path/to/llama --train_file my.txt

LoRA (peft) on the attention and MLP projections, DDL's own parameters trained in full; saves the merged model and
the adapter (in <output_dir>/adapter):

    python train.py --model_name_or_path outputs/ddl-tiny-shakespeare --train_file my.txt --lora

Resume an interrupted run (an existing output folder is never overwritten without --overwrite_output_dir; the run
keeps its checkpoint's model, data, learning rate, optimizer, batch and seed, and --max_steps can be raised to train
further):

    python train.py --output_dir outputs/ddl-tiny-shakespeare --resume_from_checkpoint true

Many processes (see configs/README.md; every TrainingArguments flag works, e.g. --gradient_checkpointing,
--bf16, --report_to tensorboard, --push_to_hub --hub_model_id me/ddl-small; on a machine without GPUs add
--use_cpu, which --bf16 needs there too; `accelerate launch --cpu` gives it):

    torchrun --nproc_per_node 8 train.py --preset small ...                              # DDP on GPUs
    torchrun --nproc_per_node 2 train.py --use_cpu ...                                   # DDP on CPU (gloo)
    accelerate launch --config_file configs/fsdp.yaml train.py --preset medium ...       # FSDP on GPUs
    accelerate launch --config_file configs/deepspeed_zero2.yaml train.py --preset medium ...
    DS_ACCELERATOR=cpu accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 2 \
        train.py --use_cpu ...                                                          # DeepSpeed on CPU

Defaults: the paper's recipe (AdamW (0.9, 0.95), weight decay 0.1, lr 1e-3 cosine with warm-up, clip 1.0) plus
per-preset run sizes (ddl_tools/presets.py: PAPER_RECIPE, PRESET_RUN_DEFAULTS); any flag you pass wins.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoTokenizer, GenerationConfig, HfArgumentParser, default_data_collator, pipeline, set_seed
from transformers.utils import logging

import ddl  # noqa: F401  (registers the DDL Auto classes and the code files saved with checkpoints)
from ddl import DDLConfig, DDLForCausalLM
from ddl.ops import choose
from ddl_tools import data, lora, resume
from ddl_tools.card import card_metadata, describe_variant, model_card, plot_loss_curve, training_time
from ddl_tools.launch import check_launch, launched_on_cpu, launcher_precision, outside_zero3
from ddl_tools.loading import check_llama_weights, check_weights, checkpoint_config, load_from_llama, load_pretrained
from ddl_tools.outputs import UsageError, write_json
from ddl_tools.presets import (PAPER_RECIPE, PRESET_RUN_DEFAULTS, PRESETS, TRAINING_SWITCHES, ddl_config_from_llama,
                               parse_config_overrides, parsed_arguments, preset_config, variant_arguments)
from ddl_tools.runs import (claim_output_dir, finish_output_dir, interruption_note, run_cli, saving_into,
                            take_output_dir)
from ddl_tools.training import DDLTrainer, DDLTrainingArguments, StepClock


# ---------------------------------------------------------------------------------------------- hyperparameters


@dataclass
class ModelArguments(variant_arguments()):  # a --ddl_* flag for every DDLConfig field of the variant, and --qk_norm*
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Continue from this DDL checkpoint (folder or Hub id): fine-tuning."}
    )
    init_from_llama: str | None = field(
        default=None,
        metadata={"help": "Build DDL from this Llama checkpoint: attention, MLP, embeddings and norms loaded by name, "
                          "DDL branches freshly initialised. The --ddl_* flags choose the variant."},
    )
    preset: str | None = field(
        default=None,
        metadata={"help": "Size of a fresh model (default tiny). small/medium are the paper's 12x768 and 24x1024.",
                  "choices": sorted(PRESETS)},
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "DDLConfig fields over the preset, e.g. 'hidden_size=256,num_hidden_layers=6'."}
    )
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "Any 🤗 tokenizer. Default: the checkpoint's, else a BPE trained here."}
    )
    vocab_size: int = field(default=4096, metadata={"help": "Vocabulary of the BPE trained when none is given."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow remote code of a non-DDL --tokenizer_name / checkpoint (DDL's own "
                                         "code is imported locally and needs no permission)."}
    )
    license: str = field(
        default="apache-2.0", metadata={"help": "The model card's license, a Hub license id (default: apache-2.0, the "
                                                "license of the code the folder ships)."}
    )
    lora: bool = field(
        default=False,
        metadata={"help": "Fine-tune with LoRA (peft: pip install 'ddl[lora]') a --model_name_or_path or "
                          "--init_from_llama model; saves the merged model, and the adapter in <output_dir>/adapter."},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str | None = field(
        default=None, metadata={"help": "Comma-separated module names LoRA adapts (default: the attention and MLP "
                                        "projections q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)."}
    )
    lora_train_ddl_branch: bool = field(
        default=True, metadata={"help": "Train DDL's own parameters (gates, values, compressors, EC, readout) in full "
                                        "alongside LoRA (false: keep them frozen)."}
    )

    def __post_init__(self):
        """Checked before anything is written: the flags against each other and the checkpoint they name (its kind,
        whole weights that fit its config). `config` is the config the run's model will have (a fresh model's
        vocabulary is its tokenizer's)."""
        self.overrides = parse_config_overrides(self.config_overrides)
        flags = {k: v for k, v in self.ddl_flags().items() if v is not None}
        if self.lora:
            lora.check_lora(self)
        if self.model_name_or_path and self.init_from_llama:
            raise UsageError("Give --model_name_or_path (a DDL checkpoint) or --init_from_llama (a Llama), not both.")
        if self.preset and (self.model_name_or_path or self.init_from_llama):
            raise UsageError("--preset shapes a fresh model; the checkpoint given sets the sizes. Drop --preset.")
        if self.model_name_or_path and (flags or self.overrides):
            raise UsageError("--config_overrides and --ddl_* flags shape a fresh model; a checkpoint given by "
                             "--model_name_or_path keeps its own architecture. Drop them.")
        if self.model_name_or_path:
            self.config = checkpoint_config(self.model_name_or_path, "--model_name_or_path")
            check_weights(self.model_name_or_path, DDLForCausalLM, self.config, "--model_name_or_path")
        elif self.init_from_llama:
            llama = checkpoint_config(self.init_from_llama, "--init_from_llama", "llama", self.trust_remote_code)
            check_llama_weights(self.init_from_llama, llama, self.overrides, flags)  # (before any data work)
            self.config = ddl_config_from_llama(llama, self.overrides, **flags)
        else:
            if not self.tokenizer_name:
                data.check_bpe_vocab_size(self.vocab_size)
            self.config = preset_config(self.preset or "tiny", self.vocab_size, self.overrides, **flags)

    def ddl_flags(self) -> dict:
        """The flags that shape a fresh model (the `--ddl_*` and QK-norm fields; not the training switches)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name.startswith(("ddl_", "qk_norm")) and f.name not in TRAINING_SWITCHES}

    def ddl_switches(self) -> dict:
        """The training switches given (`--ddl_rebuild_states`): they apply to any model, fresh or loaded."""
        return {name: getattr(self, name) for name in TRAINING_SWITCHES if getattr(self, name) is not None}

    def shaping(self) -> dict:
        """The model's config fields these flags ask for (`--preset`, `--config_overrides`, `--ddl_*`), as JSON."""
        asked = {**PRESETS.get(self.preset, {}), **self.overrides, **self.ddl_flags()}
        return json.loads(json.dumps({k: v for k, v in asked.items() if v is not None}))


@dataclass
class DataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A 🤗 dataset (default: embedded Shakespeare)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration."})
    train_file: str | None = field(
        default=None, metadata={"help": "Training text: .txt, .json, .jsonl or .csv (rows whose text is null, e.g. an "
                                        "empty CSV cell, are skipped with a warning)."}
    )
    validation_file: str | None = field(default=None, metadata={"help": "Validation text (same format)."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text (json/csv/datasets)."})
    block_size: int | None = field(default=None, metadata={"help": "Tokens per training block (packed)."})
    validation_split_percentage: float = field(
        default=5.0, metadata={"help": "Percent of train carved out for validation when there is no split."}
    )
    streaming: bool = field(default=False, metadata={"help": "Stream the dataset (large sets; needs --max_steps)."})
    streaming_validation_examples: int = field(
        default=1000, metadata={"help": "Streaming without a validation split: rows held out from the start."}
    )
    tokenizer_train_rows: int = field(
        default=200_000, metadata={"help": "Rows of training text used to train the BPE when streaming."}
    )
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "num_proc of datasets.map."})
    overwrite_cache: bool = field(default=False, metadata={"help": "Redo tokenisation even if cached."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on at most this many blocks."})
    sample_prompt: str | None = field(default=None, metadata={"help": "Prompt of the final sample."})
    sample_max_new_tokens: int = field(default=120, metadata={"help": "Length of the final sample."})

    def __post_init__(self):
        if self.block_size is not None and self.block_size < 2:
            raise UsageError(f"--block_size must be at least 2 (one input and one target token), got "
                             f"{self.block_size}.")
        for flag in ("max_eval_samples", "streaming_validation_examples"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:
                raise UsageError(f"--{flag} must be at least 1, got {getattr(self, flag)} (leave it out for its "
                                 "default).")


def parse_args(argv: list[str]):
    """The command line as our dataclasses and the training arguments, each flag checked as they are built."""
    model_args, data_args, training_args = parsed_arguments(argument_parser(argv), argv)
    if data_args.streaming and training_args.do_train and training_args.max_steps <= 0:
        raise UsageError("--streaming needs --max_steps (a streamed dataset has no length).")
    return model_args, data_args, training_args


def argument_parser(argv: list[str]) -> HfArgumentParser:
    """HfArgumentParser over our dataclasses and the training arguments, with the paper's recipe and the preset's run
    sizes as defaults (set before parsing, so every explicit flag wins)."""
    pre = argparse.ArgumentParser(add_help=False)
    for name in ("preset", "model_name_or_path", "init_from_llama", "dataset_name", "train_file", "ddl_residual",
                 "ddl_value_channels", "ddl_compressor", "ddl_embed_conv"):
        pre.add_argument(f"--{name}")
    pre.add_argument("--use_cpu", nargs="?", const="true")
    known, _ = pre.parse_known_args(argv)
    # The default folder names the variant, so `python train.py --ddl_residual additive` does not collide with
    # the default DDL run.
    variant = "".join(f"-{prefix}{value}" for prefix, value in (
        ("", known.ddl_residual), ("dv", known.ddl_value_channels), ("", known.ddl_compressor),
        ("ec-", known.ddl_embed_conv)) if value is not None)
    preset = known.preset if known.preset in PRESETS else "tiny"
    data_source = known.dataset_name or known.train_file
    data_name = os.path.splitext(os.path.basename(data_source.rstrip("/")))[0] if data_source else "shakespeare"
    source = known.model_name_or_path or known.init_from_llama
    model_name = (f"ddl-{os.path.basename(source.rstrip('/'))}" if source else f"ddl-{preset}") + variant
    # bf16 where the GPU has it; under `accelerate launch` the launch's precision (a config's mixed_precision, or
    # --mixed_precision), as DeepSpeed's config and accelerate's autocast follow it, wherever it can run: on a
    # machine without GPUs, with --use_cpu (which `accelerate launch --cpu` gives).
    gpu_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    on_cpu = known.use_cpu.lower() in ("true", "1", "yes") if known.use_cpu else launched_on_cpu()
    bf16 = launcher_precision() == "bf16" and (gpu_bf16 or on_cpu) if launcher_precision() else gpu_bf16

    parser = HfArgumentParser((ModelArguments, DataArguments, DDLTrainingArguments))
    parser.set_defaults(
        output_dir=os.path.join("outputs", f"{model_name}-{data_name}"), do_train=True, do_eval=True,
        eval_strategy="steps", save_strategy="steps", save_total_limit=2, logging_first_step=True,
        report_to="tensorboard", include_num_input_tokens_seen=True, bf16=bf16, use_cpu=on_cpu,
        dataloader_pin_memory=torch.cuda.is_available(), **PAPER_RECIPE, **PRESET_RUN_DEFAULTS[preset],
    )
    return parser


def given_flags(argv: list[str]) -> set[str]:
    """The arguments `argv` gives, in any spelling the parser accepts (--block-size, an abbreviation such as
    --learning_r, --name=value), as opposed to those left at their defaults: a resume takes the others from its
    checkpoint's record."""
    parser = argument_parser(argv)
    unset = object()  # (not a string: argparse would convert it with the argument's type)
    parser.set_defaults(**{action.dest: unset for action in parser._actions})
    namespace, _ = parser.parse_known_args(argv)
    return {name for name, value in vars(namespace).items() if value is not unset}


# ------------------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    model_args, data_args, training_args = parse_args(argv)  # every flag checked as its dataclass is built
    if training_args.should_log:
        logging.set_verbosity_warning()
    check_launch(training_args)  # FSDP on CPU, processes that are not one job, DDL's environment
    checkpoint = claim_output_dir(training_args.output_dir, training_args.resume_from_checkpoint,
                                  training_args.overwrite_output_dir, training_args.do_train,
                                  training_args.process_index == 0)  # never written over, one run at a time
    state, recorded = resume_from(checkpoint, model_args, data_args, training_args, argv)  # what is not given
    config = DDLConfig.from_pretrained(checkpoint) if checkpoint and not model_args.lora else model_args.config
    data_args.block_size = choose_block_size(data_args, config)
    weights = final_weights(checkpoint, state, training_args)  # (a run resumed at its end)
    set_seed(training_args.seed)
    start = time.time()

    raw, data_info = load_text(data_args, training_args)  # 1. the text and the tokenizer
    trains_tokenizer = not (model_args.tokenizer_name or checkpoint or model_args.model_name_or_path
                            or model_args.init_from_llama)
    if trains_tokenizer and training_args.process_index == 0:  # (checked: now it may write; the tokenizer is first)
        take_output_dir(training_args.output_dir, training_args.overwrite_output_dir, None)
    tokenizer, tokenizer_source = get_tokenizer(model_args, data_args, training_args, raw, checkpoint)
    record = resume.run_record(data_args, training_args, data_info["held_out_by"], tokenizer,
                               model_args.config if model_args.lora else None)
    if checkpoint:  # the run it continues: one comparison of the two records
        asked = record if model_args.lora else {**record, "model": {**recorded["model"], **model_args.shaping()}}
        resume.check_continues(checkpoint, recorded, asked, tokenizer_source)
    model = build_model(model_args, tokenizer, checkpoint, weights, training_args.process_index == 0)  # 2.
    blocks = pack_blocks(raw, data_info, tokenizer, model.config, data_args, training_args)  # 3. the blocks
    if not trains_tokenizer and training_args.process_index == 0:  # (checked: the tokenizer, the model, the blocks)
        take_output_dir(training_args.output_dir, training_args.overwrite_output_dir, checkpoint)
    if training_args.process_index == 0:
        describe_run(model, blocks, data_info, time.time() - start)

    trainer = DDLTrainer(model=model, args=training_args, train_dataset=blocks.train if training_args.do_train
                         else None, eval_dataset=blocks.eval, processing_class=tokenizer,
                         data_collator=default_data_collator, callbacks=[resume.DDLRunRecord(record), StepClock()])
    trainer.card_inputs = card_inputs(model_args, data_args, training_args, model.config, blocks, data_info,
                                      tokenizer_source)
    build_kernels(model.config, training_args)
    metrics = train_and_evaluate(trainer, training_args, checkpoint, state, weights is not None)  # 4. (stops if it
    saved = save_run(trainer, model_args, tokenizer, metrics, blocks, data_info)  # 5.               diverges)
    if saved is None:  # (the other processes are done)
        return
    model, metrics, curve = saved
    prompt, sample = generate_sample(training_args.output_dir, data_args, data_info, training_args)  # 6. a sample
    publish(trainer, model, metrics, curve, prompt, sample)  # 7. the model card, and the Hub if asked
    out, val = training_args.output_dir, metrics.get("eval_loss")
    print(f"\nsaved {out} in {time.time() - start:.0f}s: {metrics['tokens_seen']:,} tokens seen; final train loss "
          f"{metrics['final_train_loss']}; validation loss {val if val is None else f'{val:.4f}'} (perplexity "
          f"{metrics.get('eval_perplexity', float('nan')):.2f})")
    if metrics.get("train_runtime") and trainer.state.global_step:
        print(training_time(metrics, metrics["tokens_seen"], trainer.state.global_step, training_args.world_size)[2:])
    print(f"\n--- sample from {out} via pipeline('text-generation') ---\n{sample}")


def cli(argv: list[str]) -> int:
    """Run `main`; a user mistake becomes one `train.py: error: ...` line on stderr and exit status 2."""
    return run_cli(main, argv, "train.py", interruption_note)


# ---------------------------------------------------------------------------------------------------- steps


def resume_from(checkpoint, model_args, data_args, training_args, argv):
    """The checkpoint a run resumes (None: a fresh run): its Trainer state and its run's record, every argument not
    given taken from that record. It must hold what the run continues: a LoRA adapter for --lora, else a whole
    model whose weights fit its config (whose fields are then the record's model)."""
    if checkpoint is None:
        return None, {}
    adapter = os.path.isfile(os.path.join(checkpoint, "adapter_config.json"))
    if adapter and not model_args.lora:
        with open(os.path.join(checkpoint, "adapter_config.json"), encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path") or "BASE"
        try:
            with open(os.path.join(base, "config.json"), encoding="utf-8") as f:
                llama = json.load(f).get("model_type") != DDLConfig.model_type
        except (OSError, ValueError):  # (a Hub name or a folder gone: the usual case)
            llama = False
        raise UsageError(f"{checkpoint} holds a LoRA adapter, not a whole model: resume its run with its own flags, "
                         f"{'--init_from_llama' if llama else '--model_name_or_path'} {base} --lora (and its --lora_* "
                         "and --ddl_* values).")
    if model_args.lora and not adapter:
        raise UsageError(f"{checkpoint} holds a whole model, not a LoRA adapter: resume its run without --lora.")
    state, recorded = resume.recorded(checkpoint)
    if not adapter:
        config = DDLConfig.from_pretrained(checkpoint)
        check_weights(checkpoint, DDLForCausalLM, config, "--resume_from_checkpoint")
        recorded["model"] = resume.model_record(config)
    resume.adopt_recorded_arguments(checkpoint, recorded, given_flags(argv), data_args, training_args)
    return state, recorded


def choose_block_size(data_args, config) -> int:
    block_size = data_args.block_size or min(PRESET_RUN_DEFAULTS["tiny"]["block_size"],
                                             config.max_position_embeddings)
    if block_size > config.max_position_embeddings:
        raise UsageError(f"--block_size {block_size} exceeds the model's context (max_position_embeddings = "
                         f"{config.max_position_embeddings}). Lower --block_size, or for a fresh model raise it with "
                         f"--config_overrides max_position_embeddings={block_size}.")
    return block_size


def final_weights(checkpoint, state, training_args) -> str | None:
    """A run resumed at its last step trains nothing: the checkpoint whose weights it finishes with, as Trainer would
    have at the end of training (the best one with --load_best_model_at_end, else the last). None: steps are left."""
    if not (training_args.do_train and state and resume.steps_left(state, training_args.max_steps) <= 0):
        return None
    if not (training_args.load_best_model_at_end and state.best_model_checkpoint):
        return checkpoint
    recorded = state.best_model_checkpoint  # (where it was saved: this run's folder, moved since, or the folder of
    here = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), os.path.basename(recorded))  # the run it resumed)
    for best in (here, recorded):
        if os.path.isdir(best):
            return best
    raise UsageError(f"{checkpoint} is at its run's last step and --load_best_model_at_end asks for its best "
                     f"checkpoint, {recorded}, which is neither there nor next to it: put it back, or drop "
                     "--load_best_model_at_end to finish with the last checkpoint's weights.")


def load_text(data_args, training_args):
    """Step 1: the raw text with a validation split, and how it is organised. Rows without text (null) are skipped
    with a warning; a text column that holds no text (numbers) is refused."""
    raw, data_info = data.load_raw_datasets(data_args.dataset_name, data_args.dataset_config_name,
                                            data_args.train_file, data_args.validation_file, data_args.streaming)
    data.check_text_column(raw, data_args.text_column)
    raw = data.skip_rows_without_text(raw, data_args.text_column)  # before the split: the warning names file rows
    held_out_by = "streaming_validation_examples" if data_args.streaming else "validation_split_percentage"
    data_info["held_out_by"] = None if "validation" in raw else held_out_by  # (the flag a resume must keep, if any)
    raw = data.ensure_validation_split(raw, data_args.validation_split_percentage, training_args.seed,
                                       data_info["documents"], data_args.streaming_validation_examples)
    data.check_text_column(raw, data_args.text_column)
    return raw, data_info


def get_tokenizer(model_args, data_args, training_args, raw, checkpoint):
    """Step 1b: --tokenizer_name, else the checkpoint's (resume, fine-tuning, Llama), else a BPE trained on the
    training text by the main process and saved into the output folder (the other processes load it)."""
    path = model_args.tokenizer_name or checkpoint or model_args.model_name_or_path or model_args.init_from_llama
    if path:
        try:  # (`import ddl` resolves DDL configs)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
        except (OSError, ValueError) as err:
            raise UsageError(f"Cannot load a tokenizer from {path!r} ({err}). Give one with --tokenizer_name.") from err
        source = "checkpoint" if path == checkpoint else path
        return data.prepare_tokenizer_for_generation(tokenizer), source
    with training_args.main_process_first(desc="training the tokenizer"):
        if training_args.process_index == 0:
            start = time.time()
            max_rows = data_args.tokenizer_train_rows if data_args.streaming else None
            batches = data.text_batches(raw["train"], data_args.text_column, max_rows=max_rows)
            tokenizer = data.train_bpe_tokenizer(batches, model_args.vocab_size)
            os.makedirs(training_args.output_dir, exist_ok=True)
            tokenizer.save_pretrained(training_args.output_dir)
            print(f"tokenizer: trained a byte-level BPE (vocab {len(tokenizer)}) in {time.time() - start:.1f}s")
        else:
            tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
    source = f"byte-level BPE trained on the training text, vocab {model_args.vocab_size}"
    return data.prepare_tokenizer_for_generation(tokenizer), source


def build_model(model_args, tokenizer, checkpoint, weights, main_process: bool):
    """Step 2: the checkpoint's model (fine-tuning), DDL from Llama, or fresh from a preset + overrides + flags; for a
    run resumed at its end, with the weights it finishes with (`final_weights`), LoRA adapter included. Ready for
    saving from the start: the checkpoints, and the revisions pushed from them, load as the final folder does."""
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    if weights and not model_args.lora:  # (a LoRA run's adapter goes onto its base: `load_lora_weights`)
        model = load_pretrained(DDLForCausalLM, weights, "--resume_from_checkpoint")
    elif model_args.model_name_or_path:
        model = load_pretrained(DDLForCausalLM, model_args.model_name_or_path, "--model_name_or_path")
    elif model_args.init_from_llama:
        model = load_from_llama(model_args.init_from_llama, model_args.config)
    elif checkpoint:  # the checkpoint's architecture and weights (Trainer loads them again with its optimizer)
        model = load_pretrained(DDLForCausalLM, checkpoint, "--resume_from_checkpoint")
    else:
        flags = {k: v for k, v in model_args.ddl_flags().items() if v is not None}
        model = DDLForCausalLM(preset_config(model_args.preset or "tiny", len(tokenizer), model_args.overrides,
                                             **flags, **ids))
    if len(tokenizer) > model.config.vocab_size:
        raise UsageError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size}; use the checkpoint's tokenizer (drop --tokenizer_name).")
    for key, value in ids.items():
        if getattr(model.config, key) is None:
            setattr(model.config, key, value)
    for key, value in model_args.ddl_switches().items():
        setattr(model.config, key, value)
    finalize_for_saving(model, tokenizer)
    if not model_args.lora:
        return model
    model = lora.add_lora(model, model_args, verbose=main_process)
    if checkpoint:  # its adapter: the same LoRA on the same modules; at the run's end, its weights
        lora.check_lora_checkpoint(model, checkpoint)
        if weights:
            lora.load_lora_weights(model, weights)
    return model


def finalize_for_saving(model, tokenizer):
    """What a published checkpoint needs beyond the weights: a complete auto_map, the cache back on, and sampling
    defaults for generate()/pipeline()."""
    model.config.use_cache = True  # Trainer turns it off
    auto_map = dict(model.config.auto_map or {})
    auto_map.update({"AutoConfig": "configuration_ddl.DDLConfig", "AutoModel": "modeling_ddl.DDLModel",
                     "AutoModelForCausalLM": "modeling_ddl.DDLForCausalLM"})
    model.config.auto_map = auto_map  # save_pretrained adds only AutoConfig and the saved class
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.8, top_k=50, max_new_tokens=200, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


@dataclass
class Blocks:
    """The packed training and validation blocks, and what the run reports about them."""

    train: object
    eval: object
    block_size: int
    train_tokens: int | None  # None when streaming (no length)
    unigram: float | None  # the context-free reference loss (not computed when streaming)


def pack_blocks(raw, data_info, tokenizer, config, data_args, training_args) -> Blocks:
    """Step 3: tokenise and pack (one process at a time, so that the others reuse the datasets cache)."""
    block_size = data_args.block_size
    with training_args.main_process_first(desc="tokenising and packing"):
        packed = data.tokenize_and_pack(raw, tokenizer, data_args.text_column, block_size, data_info["documents"],
                                        data_args.preprocessing_num_workers, data_args.overwrite_cache)
    train, evaluation = packed["train"], packed["validation"]
    if data_args.max_eval_samples is not None:
        evaluation = (evaluation.take(data_args.max_eval_samples) if data_args.streaming
                      else evaluation.select(range(min(len(evaluation), data_args.max_eval_samples))))
    train_tokens = None if data_args.streaming else len(train) * block_size
    unigram = None
    if not data_args.streaming and training_args.process_index == 0:
        unigram = data.unigram_loss(train, evaluation, config.vocab_size)
    # saved with the checkpoints; set after packing, which tokenises whole documents
    tokenizer.model_max_length = min(tokenizer.model_max_length, config.max_position_embeddings)
    return Blocks(train, evaluation, block_size, train_tokens, unigram)


def describe_run(model, blocks, data_info, seconds):
    config = model.config
    print(f"model: {describe_variant(config)}, {model.num_parameters() / 1e6:.2f}M parameters, "
          f"{config.num_hidden_layers} layers x {config.hidden_size}; vocab {config.vocab_size}; block "
          f"{blocks.block_size}")
    sizes = (f"; {len(blocks.train):,} train blocks ({blocks.train_tokens:,} tokens), {len(blocks.eval):,} validation "
             f"blocks; unigram validation loss {blocks.unigram:.3f}" if blocks.train_tokens else " (streaming)")
    print(f"data: {data_info['name']}{sizes}; prepared in {seconds:.1f}s")


def card_inputs(model_args, data_args, training_args, config, blocks, data_info, tokenizer_source) -> dict:
    """What the model card says about the run apart from its progress and results (`model_card`'s other inputs):
    the final card and the card of every revision pushed during training."""
    return dict(repo_name=training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir)),
                config=config, data_name=data_info["name"], block_size=blocks.block_size,
                tokenizer_source=tokenizer_source, train_tokens=blocks.train_tokens, training_args=training_args,
                unigram=blocks.unigram, init_from=init_source(model_args), finetuning=lora.describe_lora(model_args),
                metadata=card_metadata(license_id=model_args.license, dataset_name=data_args.dataset_name,
                                       base=model_args.model_name_or_path or model_args.init_from_llama))


def init_source(model_args) -> str | None:
    """What a run started from, in the model card's words (None: from scratch)."""
    if model_args.init_from_llama:
        return f"the Llama checkpoint `{model_args.init_from_llama}`"
    if model_args.model_name_or_path:
        return f"the DDL checkpoint `{model_args.model_name_or_path}`"
    return None


def build_kernels(config, training_args):
    """ddl_kernels' C++ CPU kernels (when installed), loaded before the clock of `train_runtime` starts (built at
    install; a missing build is one line here, not in the first step). Not for bf16/fp16 runs: autocast takes
    PyTorch."""
    low_precision = training_args.bf16 or training_args.fp16
    if training_args.device.type == "cpu" and choose(config.ddl_implementation) in ("auto", "triton") and not (
            low_precision):
        try:
            from ddl_kernels.build import kernels
        except ImportError:  # PyTorch paths only
            return
        kernels()


def train_and_evaluate(trainer, training_args, checkpoint, state, finished: bool) -> dict:
    """Step 4: train (from `checkpoint`, at `state`, if given), then the validation loss of the final weights.
    `finished`: the checkpoint is at the run's last step and the model holds the weights it finishes with."""
    metrics = {}
    if training_args.do_train and finished:  # (Trainer would train one step past the end)
        trainer.state = state
        metrics["resumed_at_step"] = state.global_step
        if trainer.is_world_process_zero():
            print(f"{checkpoint} is at step {state.global_step}, the run's last: no step left to train; finishing "
                  "the run from it (raise --max_steps to train further).")
    elif training_args.do_train:
        result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics.update(result.metrics)
        if state:  # train_runtime covers only the steps after the checkpoint (the model card's speed)
            metrics["resumed_at_step"] = state.global_step
        trainer.log_metrics("train", result.metrics)
        clock = next(c for c in trainer.callback_handler.callbacks if isinstance(c, StepClock))
        metrics["train_steady_seconds"], metrics["train_steady_steps"] = clock.steady()
        mixed, weights = trainer.accelerator.mixed_precision, next(trainer.model.parameters()).dtype
        weights = str(weights).removeprefix("torch.")
        metrics["precision"] = f"{mixed} mixed precision ({weights} weights)" if mixed != "no" else weights
        metrics["compiled"] = bool(training_args.torch_compile)
    # Without train(), DeepSpeed's engine, through which Trainer saves the model, is built by evaluate()
    no_engine = trainer.is_deepspeed_enabled and trainer.deepspeed is None
    if training_args.do_eval or no_engine:
        last = [e for e in trainer.state.log_history if "eval_loss" in e]
        if last and last[-1]["step"] == trainer.state.global_step and not no_engine and not (  # the last step was
                training_args.load_best_model_at_end and trainer.state.best_model_checkpoint):  # evaluated and saved
            eval_metrics = {k: v for k, v in last[-1].items() if k.startswith("eval_") or k == "epoch"}
        else:
            eval_metrics = trainer.evaluate()
        eval_metrics["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50))
        trainer.log_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    return metrics


def save_run(trainer, model_args, tokenizer, metrics, blocks, data_info):
    """Step 5: a complete checkpoint folder (a full disk: one line, and the folder stays resumable); LoRA's adapter
    beside the merged model. The main process returns the model saved, the run's results and its loss curve."""
    model = lora.save_adapter_and_merge(trainer) if model_args.lora else trainer.model
    finalize_for_saving(model, tokenizer)
    args, state, out = trainer.args, trainer.state, trainer.args.output_dir
    with saving_into(out, "the final model"):
        trainer.save_model()
        trainer.save_state()
        if not trainer.is_world_process_zero():
            return None
        losses = [e["loss"] for e in state.log_history if "loss" in e]
        device = (torch.cuda.get_device_name() if args.device.type == "cuda"
                  else f"CPU, {torch.get_num_threads()} torch threads")
        metrics = dict(metrics, final_train_loss=losses[-1] if losses else None, unigram_loss=blocks.unigram,
                       tokens_seen=resume.tokens_seen(state, args, blocks.block_size), device=device)
        if init_source(model_args):
            metrics["init_from"] = init_source(model_args)
        write_json(os.path.join(out, "all_results.json"), metrics)
        curve = plot_loss_curve(state.log_history, os.path.join(out, "loss_curve.png"),
                                title=f"{describe_variant(model.config)} on {data_info['name'].split(' (')[0]}",
                                unigram=blocks.unigram)
    return model, metrics, curve


def generate_sample(out, data_args, data_info, training_args) -> tuple[str, str]:
    """Step 6: a sample through `pipeline("text-generation")` from the saved folder (by remote code, as a user
    would load it)."""
    prompt = data_args.sample_prompt or ("Romeo.\n" if data_info["name"].startswith("shakespeare") else "The")
    with outside_zero3():  # this process alone loads and generates (under ZeRO-3 both would wait for the others)
        generator = pipeline("text-generation", model=out, tokenizer=out, trust_remote_code=True, device="cpu")
        torch.manual_seed(training_args.seed)
        return prompt, generator(prompt, max_new_tokens=data_args.sample_max_new_tokens)[0]["generated_text"]


def publish(trainer, model, metrics, curve, prompt, sample) -> None:
    """Step 7: the model card, which marks the folder a finished run; then the Hub, if asked."""
    trainer.ddl_model_card = model_card(
        **trainer.card_inputs, num_parameters=model.num_parameters(), steps=trainer.state.global_step,
        metrics=metrics, loss_curve=curve, sample=sample, prompt=prompt)
    with saving_into(trainer.args.output_dir, "the model card"):
        trainer.create_model_card()
        finish_output_dir(trainer.args.output_dir)  # everything is saved: the folder is a finished run
    if trainer.args.push_to_hub:
        trainer.push_to_hub(commit_message="End of training")


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
