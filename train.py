"""Pretrain or fine-tune a Deep Delta Learning (DDL) language model, or one of its baselines, with 🤗 Trainer.

Zero arguments train a tiny DDL (d_v = 4, CC compressor, EC: the paper's default variant) on the embedded
Shakespeare corpus in about 5 minutes on 2 idle CPU cores (260–320 s measured; longer on a busy machine), save a
complete checkpoint folder (weights, config with auto_map, the model's .py files, tokenizer, generation config,
trainer_state.json, model card with loss curve)
and print a sample generated from that folder:

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
--use_cpu, which --bf16 needs there too):

    torchrun --nproc_per_node 8 train.py --preset small ...                              # DDP on GPUs
    torchrun --nproc_per_node 2 train.py --use_cpu ...                                   # DDP on CPU (gloo)
    accelerate launch --config_file configs/fsdp.yaml train.py --preset medium ...       # FSDP on GPUs
    accelerate launch --config_file configs/deepspeed_zero2.yaml train.py --preset medium ...
    DS_ACCELERATOR=cpu accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 2 \
        train.py --use_cpu ...                                                          # DeepSpeed on CPU

A streamed run resumes where its checkpoint left the stream, without reading again what it consumed.

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
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    HfArgumentParser,
    TrainingArguments,
    default_data_collator,
    pipeline,
    set_seed,
)
from transformers.utils import logging

import ddl  # noqa: F401  (registers the DDL Auto classes and the code files saved with checkpoints)
from ddl import DDLConfig, DDLForCausalLM
from ddl_tools.hub import check_hub_strategy
from ddl_tools.launch import check_launch, end_process_group, launcher_precision, outside_zero3
from ddl_tools.lora import (add_lora, check_lora, check_lora_checkpoint, describe_lora, load_lora_weights,
                            save_adapter_and_merge)
from ddl_tools.outputs import write_json
from ddl_tools.card import card_metadata, describe_variant, model_card, plot_loss_curve
from ddl_tools.data import (
    check_bpe_vocab_size,
    check_text_column,
    ensure_validation_split,
    load_raw_datasets,
    prepare_tokenizer_for_generation,
    skip_rows_without_text,
    text_batches,
    tokenize_and_pack,
    train_bpe_tokenizer,
    unigram_loss,
)
from ddl_tools.loading import (
    check_llama_weights,
    check_weights,
    checkpoint_config,
    load_ddl_checkpoint,
    load_from_llama,
    load_pretrained,
)
from ddl_tools.outputs import UsageError
from ddl_tools.presets import (
    PAPER_RECIPE,
    PRESETS,
    PRESET_RUN_DEFAULTS,
    TRAINING_SWITCHES,
    check_ddl_environment,
    check_training_arguments,
    config_error_message,
    ddl_config_from_llama,
    parse_config_overrides,
    parsed_arguments,
    preset_config,
    variant_arguments,
)
from ddl_tools.resume import (
    DDLRunRecord,
    check_resumed_data,
    check_resumed_lora_model,
    check_resumed_model,
    data_record,
    model_record,
    resumed_block_size,
    resumed_split,
    resumed_state,
    resumed_training_arguments,
    steps_left,
    tokenizer_digest,
    tokens_seen,
    training_record,
)
from ddl_tools.runs import (claim_output_dir, finish_output_dir, interruption_note, take_output_dir,
                            release_output_dirs, saving_into)
from ddl_tools.training import DDLTrainer



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

    def ddl_flags(self) -> dict:
        """The flags that shape a fresh model (the `--ddl_*` and QK-norm fields; not the training switches)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name.startswith(("ddl_", "qk_norm")) and f.name not in TRAINING_SWITCHES}

    def ddl_switches(self) -> dict:
        """The training switches given (`--ddl_rebuild_states`): they apply to any model, fresh or loaded."""
        return {name: getattr(self, name) for name in TRAINING_SWITCHES if getattr(self, name) is not None}


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


@dataclass
class RunArguments:
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow writing into a non-empty --output_dir (otherwise: error, or resume)."}
    )
    license: str | None = field(
        default=None, metadata={"help": "The model card's license, a Hub license id (apache-2.0, mit, ...); none if "
                                        "not given."}
    )


def parse_args(argv: list[str]):
    """The command line as our dataclasses and TrainingArguments (`argument_parser`)."""
    return parsed_arguments(argument_parser(argv), argv)


def argument_parser(argv: list[str]) -> HfArgumentParser:
    """HfArgumentParser over our dataclasses and TrainingArguments, with the paper's recipe and the preset's run
    sizes as defaults (set before parsing, so every explicit flag wins)."""
    pre = argparse.ArgumentParser(add_help=False)
    for name in ("preset", "model_name_or_path", "init_from_llama", "dataset_name", "train_file", "output_dir",
                 "ddl_residual", "ddl_value_channels", "ddl_compressor", "ddl_embed_conv"):
        pre.add_argument(f"--{name}")
    pre.add_argument("--use_cpu", nargs="?", const="true", default="false")
    known, _ = pre.parse_known_args(argv)
    # The default folder names the variant, so `python train.py --ddl_residual additive` does not collide with
    # the default DDL run.
    variant = "".join(f"-{prefix}{value}" for prefix, value in (
        ("", known.ddl_residual), ("dv", known.ddl_value_channels), ("", known.ddl_compressor),
        ("ec-", known.ddl_embed_conv)) if value is not None)
    preset = known.preset if known.preset in PRESETS else "tiny"
    if known.dataset_name or known.train_file:
        data_name = os.path.splitext(os.path.basename((known.dataset_name or known.train_file).rstrip("/")))[0]
    else:
        data_name = "shakespeare"
    source = known.model_name_or_path or known.init_from_llama
    model_name = (f"ddl-{os.path.basename(source.rstrip('/'))}" if source else f"ddl-{preset}") + variant
    # bf16 where the GPU has it; `accelerate launch` states the run's precision (a config's mixed_precision, or
    # --mixed_precision), which the default follows, as DeepSpeed's config and accelerate's autocast do, wherever it
    # can run (on a machine without GPUs, with --use_cpu; without it the launch is refused first, by `check_launch`).
    gpu_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    launcher, on_cpu = launcher_precision(), known.use_cpu.lower() in ("true", "1", "yes")
    bf16 = launcher == "bf16" and (gpu_bf16 or on_cpu) if launcher else gpu_bf16

    parser = HfArgumentParser((ModelArguments, DataArguments, RunArguments, TrainingArguments))
    parser.set_defaults(
        output_dir=os.path.join("outputs", f"{model_name}-{data_name}"),
        do_train=True,
        do_eval=True,
        eval_strategy="steps",
        save_strategy="steps",
        save_total_limit=2,
        logging_first_step=True,
        report_to="tensorboard",
        include_num_input_tokens_seen=True,
        bf16=bf16,
        dataloader_pin_memory=torch.cuda.is_available(),
        **PAPER_RECIPE,
        **PRESET_RUN_DEFAULTS[preset],
    )
    return parser


def given_flags(argv: list[str]) -> set[str]:
    """The arguments `argv` gives, in any spelling the parser accepts (--block-size, an abbreviation such as
    --learning_r, --name=value), as opposed to those left at their defaults: a resumed run keeps its checkpoint's
    value of every argument not given (`check_resume`)."""
    parser = argument_parser(argv)
    unset = object()  # (not a string: argparse would convert it with the argument's type)
    parser.set_defaults(**{action.dest: unset for action in parser._actions})
    namespace, _ = parser.parse_known_args(argv)
    return {name for name, value in vars(namespace).items() if value is not unset}


# ---------------------------------------------------------------------------------------------------- helpers


def check_run_length(training_args: TrainingArguments) -> None:
    """Trainer reads any --max_steps <= 0 as "train --num_train_epochs epochs" (-3 would train 3 epochs)."""
    if training_args.max_steps == 0 or training_args.max_steps < -1:
        raise UsageError(f"--max_steps {training_args.max_steps}: give a positive number of optimizer steps, or -1 to "
                         "train for --num_train_epochs epochs.")


def check_arguments(data_args, training_args) -> None:
    """Before anything is written: the run's length, Trainer's numbers, DDL's environment variables, a block size
    (`--block_size 0` used to mean "unset", i.e. 256) and the validation's size."""
    check_run_length(training_args)
    check_training_arguments(training_args)
    check_ddl_environment()
    if data_args.block_size is not None and data_args.block_size < 2:
        raise UsageError(f"--block_size must be at least 2 (one input and one target token), got "
                         f"{data_args.block_size}.")
    for flag, value in (("--max_eval_samples", data_args.max_eval_samples),
                        ("--streaming_validation_examples", data_args.streaming_validation_examples)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value} (leave it out for its default).")


def resolve_resume(training_args: TrainingArguments, run_args: RunArguments) -> str | None:
    """Which checkpoint to resume from (None = start fresh), with the output folder made this run's: never written
    over without --overwrite_output_dir, one run at a time (ddl_tools.runs.claim_output_dir)."""
    return claim_output_dir(training_args.output_dir, training_args.resume_from_checkpoint,
                            run_args.overwrite_output_dir, training_args.do_train, training_args.process_index == 0)


def check_resume(resume, model_args, data_args, training_args, argv) -> None:
    """A resumed run continues its checkpoint: the same model (a flag asking for another is refused; weights that do
    not fit its config are one line), the same blocks (its recorded block size; another --block_size is refused) and
    the same training (its recorded learning rate, optimizer, batch and seed, which Trainer restores or counts its
    position in: another value given is refused; `resumed_training_arguments`). What is not given is the
    checkpoint's. Its data and tokenizer are checked once loaded (`check_resumed_data`)."""
    adapter = os.path.isfile(os.path.join(resume, "adapter_config.json"))  # (a --lora run's checkpoint)
    if adapter and not model_args.lora:
        with open(os.path.join(resume, "adapter_config.json"), encoding="utf-8") as f:
            base = json.load(f).get("base_model_name_or_path") or "BASE"
        flag = "--model_name_or_path" if is_ddl_checkpoint(base) else "--init_from_llama"
        raise UsageError(f"{resume} holds a LoRA adapter, not a whole model: resume its run with its own flags, "
                         f"{flag} {base} --lora (and its --lora_* and --ddl_* values).")
    if model_args.lora and not adapter:
        raise UsageError(f"{resume} holds a whole model, not a LoRA adapter: resume its run without --lora.")
    if not adapter:  # (an adapter's model is its base and this command's flags: `check_lora_checkpoint`)
        flags = {k: v for k, v in model_args.ddl_flags().items() if v is not None}
        check_resumed_model(resume, model_args.preset, parse_config_overrides(model_args.config_overrides), flags)
        check_weights(resume, DDLForCausalLM, DDLConfig.from_pretrained(resume), "--resume_from_checkpoint")
    given, state = given_flags(argv), resumed_state(resume)
    data_args.block_size = resumed_block_size(resume, state, data_args.block_size, "block_size" in given)
    resumed_split(resume, state, data_args, given)
    resumed_training_arguments(resume, state, training_args, given)


def is_ddl_checkpoint(path: str) -> bool:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type") == DDLConfig.model_type
    except (OSError, ValueError):
        return True  # (a Hub name or a folder gone: the usual case)


def load_tokenizer(path: str, trust_remote_code: bool):
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UsageError(f"Cannot load a tokenizer from {path!r} ({err}). Give one with --tokenizer_name.") from err


def get_tokenizer(model_args, data_args, training_args, raw, resume):
    """The tokenizer: --tokenizer_name, else the checkpoint's (resume, fine-tuning, Llama), else a BPE trained on
    the training text by the main process and saved into the output folder (the other processes load it)."""
    if model_args.tokenizer_name:
        tokenizer = load_tokenizer(model_args.tokenizer_name, model_args.trust_remote_code)
        source = model_args.tokenizer_name
    elif resume or model_args.model_name_or_path or model_args.init_from_llama:
        path = resume or model_args.model_name_or_path or model_args.init_from_llama
        tokenizer = load_tokenizer(path, model_args.trust_remote_code)  # `import ddl` resolves DDL configs
        source = "checkpoint" if resume else path
    else:
        with training_args.main_process_first(desc="training the tokenizer"):
            if training_args.process_index == 0:
                start = time.time()
                max_rows = data_args.tokenizer_train_rows if data_args.streaming else None
                batches = text_batches(raw["train"], data_args.text_column, max_rows=max_rows)
                tokenizer = train_bpe_tokenizer(batches, model_args.vocab_size)
                os.makedirs(training_args.output_dir, exist_ok=True)
                tokenizer.save_pretrained(training_args.output_dir)
                print(f"tokenizer: trained a byte-level BPE (vocab {len(tokenizer)}) in {time.time() - start:.1f}s")
            else:
                tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
        source = f"byte-level BPE trained on the training text, vocab {model_args.vocab_size}"
    return prepare_tokenizer_for_generation(tokenizer), source


def check_model_source(model_args, resume):
    """Fail fast (before any data work) on a checkpoint of the wrong kind or flags that cannot apply to it. Returns
    the config the run's model will have (a fresh model's vocabulary is fixed later by its tokenizer)."""
    if model_args.lora:
        check_lora(model_args)
    if model_args.model_name_or_path and model_args.init_from_llama:
        raise UsageError("Give --model_name_or_path (a DDL checkpoint) or --init_from_llama (a Llama), not both.")
    source = model_args.model_name_or_path or model_args.init_from_llama
    flags = {k: v for k, v in model_args.ddl_flags().items() if v is not None}
    overrides = parse_config_overrides(model_args.config_overrides)
    if source is None:  # validate the fresh model's config now
        if not (resume or model_args.tokenizer_name):  # (its tokenizer is trained once the folder is taken)
            check_bpe_vocab_size(model_args.vocab_size)
        config = preset_config(model_args.preset or "tiny", model_args.vocab_size, overrides, **flags)
        return DDLConfig.from_pretrained(resume) if resume else config
    if model_args.preset:
        raise UsageError("--preset shapes a fresh model; the checkpoint given sets the sizes. Drop --preset.")
    if model_args.model_name_or_path and (flags or overrides):
        raise UsageError("--config_overrides and --ddl_* flags shape a fresh model; a checkpoint given by "
                         "--model_name_or_path keeps its own architecture. Drop them.")
    flag = "--model_name_or_path" if model_args.model_name_or_path else "--init_from_llama"
    config = checkpoint_config(source, flag, DDLConfig.model_type if model_args.model_name_or_path else "llama",
                               model_args.trust_remote_code)
    if model_args.model_name_or_path:
        check_weights(source, DDLForCausalLM, config, flag)
        return config
    # (before the tokenizer and the data: from_pretrained's size-mismatch traceback came after them)
    check_llama_weights(source, config, overrides, flags)
    return ddl_config_from_llama(config, overrides, **flags)


def final_weights(resume, training_args) -> str | None:
    """A run resumed at its last step trains nothing: the checkpoint whose weights it finishes with, as Trainer would
    have at the end of training (the best one with --load_best_model_at_end, else the last). None: steps are left."""
    state = resumed_state(resume)
    if not (training_args.do_train and state and steps_left(state, training_args.max_steps) <= 0):
        return None
    if not (training_args.load_best_model_at_end and state.best_model_checkpoint):
        return resume
    recorded = state.best_model_checkpoint  # (where it was saved: this run's folder, moved since, or the folder of
    here = os.path.join(os.path.dirname(os.path.abspath(resume)), os.path.basename(recorded))  # the run it resumed)
    for best in (here, recorded):
        if os.path.isdir(best):
            return best
    raise UsageError(f"{resume} is at its run's last step and --load_best_model_at_end asks for its best checkpoint, "
                     f"{recorded}, which is neither there nor next to it: put it back, or drop "
                     "--load_best_model_at_end to finish with the last checkpoint's weights.")


def build_model(model_args, tokenizer, resume, weights):
    """The model: the checkpoint's (fine-tuning), DDL from Llama, or fresh from a preset + overrides + flags; for a
    run resumed at its end, with the weights it finishes with (`final_weights`), LoRA adapter included."""
    flags = {k: v for k, v in model_args.ddl_flags().items() if v is not None}
    overrides = parse_config_overrides(model_args.config_overrides)
    ids = dict(pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)
    if weights and not model_args.lora:  # (a LoRA run's adapter goes onto its base: `load_lora_weights`)
        model = load_pretrained(DDLForCausalLM, weights, "--resume_from_checkpoint")
    elif model_args.model_name_or_path:
        model = load_ddl_checkpoint(model_args.model_name_or_path)
    elif model_args.init_from_llama:
        try:
            llama_config = AutoConfig.from_pretrained(model_args.init_from_llama)
        except (OSError, ValueError) as err:
            raise UsageError(f"--init_from_llama {model_args.init_from_llama!r}: cannot read a config ({err}).")
        config = ddl_config_from_llama(llama_config, overrides, **flags)
        model = load_from_llama(model_args.init_from_llama, config)
    elif resume:  # the checkpoint's architecture and weights (Trainer loads them again with its optimizer)
        model = load_pretrained(DDLForCausalLM, resume, "--resume_from_checkpoint")
    else:
        config = preset_config(model_args.preset or "tiny", len(tokenizer), overrides, **flags, **ids)
        model = DDLForCausalLM(config)
    if len(tokenizer) > model.config.vocab_size:
        raise UsageError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size}; use the checkpoint's tokenizer (drop --tokenizer_name).")
    for key, value in ids.items():
        if getattr(model.config, key) is None:
            setattr(model.config, key, value)
    for key, value in model_args.ddl_switches().items():
        setattr(model.config, key, value)
    return model


def finalize_for_saving(model, tokenizer):
    """What a published checkpoint needs beyond the weights: a complete auto_map, the cache back on, and sampling
    defaults for generate()/pipeline()."""
    model.config.use_cache = True  # Trainer turned it off (TRANSFORMERS_V5.md P13)
    auto_map = dict(model.config.auto_map or {})
    auto_map.update({"AutoConfig": "configuration_ddl.DDLConfig", "AutoModel": "modeling_ddl.DDLModel",
                     "AutoModelForCausalLM": "modeling_ddl.DDLForCausalLM"})
    model.config.auto_map = auto_map  # save_pretrained adds only AutoConfig and the saved class (P12)
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.8, top_k=50, max_new_tokens=200, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )


def final_train_loss(log_history) -> float | None:
    losses = [e["loss"] for e in log_history if "loss" in e]
    return losses[-1] if losses else None


@dataclass
class Blocks:
    """The packed training and validation blocks, and what the run reports about them."""

    train: object
    eval: object
    block_size: int
    train_tokens: int | None  # None when streaming (no length)
    unigram: float | None  # the context-free reference loss (not computed when streaming)


def choose_block_size(data_args, config) -> int:
    block_size = data_args.block_size
    if block_size is None:
        block_size = min(PRESET_RUN_DEFAULTS["tiny"]["block_size"], config.max_position_embeddings)
    if block_size > config.max_position_embeddings:
        raise UsageError(f"--block_size {block_size} exceeds the model's context (max_position_embeddings = "
                         f"{config.max_position_embeddings}). Lower --block_size, or for a fresh model raise it with "
                         f"--config_overrides max_position_embeddings={block_size}.")
    if block_size < 2:
        raise UsageError(f"--block_size must be at least 2 (one input and one target token), got {block_size}.")
    return block_size


def load_text(data_args, training_args):
    """Step 1: the raw text with a validation split, and how it is organised. Rows without text (null) are skipped
    with a warning; a text column that holds no text (numbers) is refused."""
    raw, data_info = load_raw_datasets(data_args.dataset_name, data_args.dataset_config_name, data_args.train_file,
                                       data_args.validation_file, data_args.streaming)
    check_text_column(raw, data_args.text_column)
    raw = skip_rows_without_text(raw, data_args.text_column)  # before the split: the warning names the file's rows
    held_out_by = "streaming_validation_examples" if data_args.streaming else "validation_split_percentage"
    data_info["held_out_by"] = None if "validation" in raw else held_out_by  # (the flag a resume must keep, if any)
    raw = ensure_validation_split(raw, data_args.validation_split_percentage, training_args.seed,
                                  data_info["documents"], data_args.streaming_validation_examples)
    check_text_column(raw, data_args.text_column)
    if data_args.streaming and training_args.do_train and training_args.max_steps <= 0:
        raise UsageError("--streaming needs --max_steps (a streamed dataset has no length).")
    return raw, data_info


def pack_blocks(raw, data_info, tokenizer, block_size, vocab_size, data_args, training_args) -> Blocks:
    """Step 3: tokenise and pack (one process at a time, so that the others reuse the datasets cache)."""
    with training_args.main_process_first(desc="tokenising and packing"):
        packed = tokenize_and_pack(raw, tokenizer, data_args.text_column, block_size, data_info["documents"],
                                   data_args.preprocessing_num_workers, data_args.overwrite_cache)
    train, evaluation = packed["train"], packed["validation"]
    if data_args.max_eval_samples is not None:
        evaluation = (evaluation.take(data_args.max_eval_samples) if data_args.streaming
                      else evaluation.select(range(min(len(evaluation), data_args.max_eval_samples))))
    train_tokens = None if data_args.streaming else len(train) * block_size
    unigram = None
    if not data_args.streaming and training_args.process_index == 0:
        unigram = unigram_loss(train, evaluation, vocab_size)
    return Blocks(train, evaluation, block_size, train_tokens, unigram)


def describe_run(model, blocks, data_info, seconds):
    config = model.config
    print(f"model: {describe_variant(config)}, {model.num_parameters() / 1e6:.2f}M parameters, "
          f"{config.num_hidden_layers} layers x {config.hidden_size}; vocab {config.vocab_size}; block "
          f"{blocks.block_size}")
    sizes = (f"; {len(blocks.train):,} train blocks ({blocks.train_tokens:,} tokens), {len(blocks.eval):,} validation "
             f"blocks; unigram validation loss {blocks.unigram:.3f}" if blocks.train_tokens else " (streaming)")
    print(f"data: {data_info['name']}{sizes}; prepared in {seconds:.1f}s")


def build_kernels(config, training_args):
    """ddl_kernels' C++ CPU kernels (when installed), loaded before the clock of `train_runtime` starts (built at
    install; a missing build is one line here, not in the first step). Not for bf16/fp16 runs: autocast takes
    PyTorch."""
    low_precision = training_args.bf16 or training_args.fp16
    if training_args.device.type == "cpu" and config.ddl_implementation in ("auto", "triton") and not low_precision:
        try:
            from ddl_kernels.build import kernels
        except ImportError:  # PyTorch paths only
            return
        kernels()


def train_and_evaluate(trainer, training_args, resume, finished: bool) -> dict:
    """Step 4: train (from `resume`, if given), then the validation loss of the final weights. `finished`: `resume`
    is at the run's last step and the model holds the weights it finishes with (`final_weights`)."""
    metrics = {}
    resumed = resumed_state(resume)  # read now: checkpoint rotation may delete it during training
    if training_args.do_train and finished:  # (Trainer would train one step past the end)
        trainer.state = resumed
        metrics["resumed_at_step"] = resumed.global_step
        if trainer.is_world_process_zero():
            print(f"{resume} is at step {resumed.global_step}, the run's last: no step left to train; finishing the "
                  "run from it (raise --max_steps to train further).")
    elif training_args.do_train:
        result = trainer.train(resume_from_checkpoint=resume)
        metrics.update(result.metrics)
        if resumed:  # train_runtime covers only the steps after the checkpoint (the model card's speed)
            metrics["resumed_at_step"] = resumed.global_step
        trainer.log_metrics("train", result.metrics)
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


def run_metrics(trainer, metrics, model_args, training_args, blocks) -> dict:
    """What all_results.json and the model card report, beyond Trainer's own metrics."""
    state = trainer.state
    device = (torch.cuda.get_device_name() if training_args.device.type == "cuda"
              else f"CPU, {torch.get_num_threads()} torch threads")
    metrics = dict(metrics, final_train_loss=final_train_loss(state.log_history),
                   tokens_seen=tokens_seen(state, training_args, blocks.block_size), unigram_loss=blocks.unigram,
                   device=device)
    if init_source(model_args):
        metrics["init_from"] = init_source(model_args)
    return metrics


def init_source(model_args) -> str | None:
    """What a run started from, in the model card's words (None: from scratch)."""
    if model_args.init_from_llama:
        return f"the Llama checkpoint `{model_args.init_from_llama}`"
    if model_args.model_name_or_path:
        return f"the DDL checkpoint `{model_args.model_name_or_path}`"
    return None


def card_inputs(model_args, data_args, run_args, training_args, config, blocks, data_info, tokenizer_source) -> dict:
    """What the model card says about the run apart from its progress and results (`model_card`'s other inputs):
    the final card and the card of every revision pushed during training."""
    return dict(repo_name=training_args.hub_model_id or os.path.basename(os.path.abspath(training_args.output_dir)),
                config=config, data_name=data_info["name"], block_size=blocks.block_size,
                tokenizer_source=tokenizer_source, train_tokens=blocks.train_tokens, training_args=training_args,
                unigram=blocks.unigram, init_from=init_source(model_args), finetuning=describe_lora(model_args),
                metadata=card_metadata(license_id=run_args.license, dataset_name=data_args.dataset_name,
                                       base=model_args.model_name_or_path or model_args.init_from_llama))


def generate_sample(out, data_args, data_info, training_args) -> tuple[str, str]:
    """Step 6: a sample through `pipeline("text-generation")` from the saved folder (by remote code, as a user
    would load it)."""
    prompt = data_args.sample_prompt or ("Romeo.\n" if data_info["name"].startswith("shakespeare") else "The")
    with outside_zero3():  # this process alone loads and generates (under ZeRO-3 both would wait for the others)
        generator = pipeline("text-generation", model=out, tokenizer=out, trust_remote_code=True, device="cpu")
        torch.manual_seed(training_args.seed)
        return prompt, generator(prompt, max_new_tokens=data_args.sample_max_new_tokens)[0]["generated_text"]


# ------------------------------------------------------------------------------------------------------- main


def main(argv: list[str]) -> None:
    model_args, data_args, run_args, training_args = parse_args(argv)
    if training_args.should_log:
        logging.set_verbosity_warning()
    check_arguments(data_args, training_args)
    check_launch(training_args)  # before anything is written: FSDP on CPU, processes that are not one job
    check_hub_strategy(training_args)
    resume = resolve_resume(training_args, run_args)
    if resume:
        check_resume(resume, model_args, data_args, training_args, argv)
    config = check_model_source(model_args, resume)
    block_size = choose_block_size(data_args, config)
    weights = final_weights(resume, training_args)  # (a run resumed at its end)
    set_seed(training_args.seed)
    start = time.time()

    raw, data_info = load_text(data_args, training_args)  # 1. the text
    trains_tokenizer = not (model_args.tokenizer_name or resume or model_args.model_name_or_path
                            or model_args.init_from_llama)
    if trains_tokenizer and training_args.process_index == 0:  # (checked: now it may write; the tokenizer is first)
        take_output_dir(training_args.output_dir, run_args.overwrite_output_dir, None)
    tokenizer, tokenizer_source = get_tokenizer(model_args, data_args, training_args, raw, resume)
    record = run_record(data_args, data_info, tokenizer)
    if resume:
        check_resumed_data(resume, resumed_state(resume), *record, model_args.tokenizer_name or "the checkpoint's")
    model = build_model(model_args, tokenizer, resume, weights)  # 2. the model
    finalize_for_saving(model, tokenizer)  # already for the checkpoints, and the revisions pushed from them
    if model_args.lora:
        model = add_lora(model, model_args, verbose=training_args.process_index == 0)
        if resume:  # its adapter: on the same model, the same LoRA on the same modules; at the run's end, its weights
            check_resumed_lora_model(resume, resumed_state(resume), model.config)
            check_lora_checkpoint(model, resume)
            if weights:
                load_lora_weights(model, weights)
    config = model.config
    blocks = pack_blocks(raw, data_info, tokenizer, block_size, config.vocab_size, data_args, training_args)  # 3.
    if not trains_tokenizer and training_args.process_index == 0:  # (checked: the tokenizer, the model, the blocks)
        take_output_dir(training_args.output_dir, run_args.overwrite_output_dir, resume)
    if training_args.process_index == 0:
        describe_run(model, blocks, data_info, time.time() - start)
    if tokenizer.model_max_length > config.max_position_embeddings:
        tokenizer.model_max_length = config.max_position_embeddings  # saved with the checkpoint (after packing)

    run_record_callback = DDLRunRecord(blocks.block_size, *record, training_record(training_args),
                                       model_record(config) if model_args.lora else None)
    trainer = DDLTrainer(model=model, args=training_args, train_dataset=blocks.train if training_args.do_train
                         else None, eval_dataset=blocks.eval, processing_class=tokenizer,
                         data_collator=default_data_collator, callbacks=[run_record_callback])
    trainer.card_inputs = card_inputs(model_args, data_args, run_args, training_args, config, blocks, data_info,
                                      tokenizer_source)
    build_kernels(config, training_args)
    metrics = train_and_evaluate(trainer, training_args, resume, weights is not None)  # 4. (stops if it diverges)

    if model_args.lora:
        model = save_adapter_and_merge(trainer)  # the adapter; the merged model is what is saved below
    finalize_for_saving(model, tokenizer)  # 5. a complete checkpoint folder
    out = training_args.output_dir
    with saving_into(out, "the final model"):  # a full disk: one line, and the folder stays resumable
        trainer.save_model()
        trainer.save_state()
        if not trainer.is_world_process_zero():
            return
        metrics = run_metrics(trainer, metrics, model_args, training_args, blocks)
        write_json(os.path.join(out, "all_results.json"), metrics)
        curve = plot_loss_curve(trainer.state.log_history, os.path.join(out, "loss_curve.png"),
                                title=f"{describe_variant(config)} on {data_info['name'].split(' (')[0]}",
                                unigram=blocks.unigram)
    prompt, sample = generate_sample(out, data_args, data_info, training_args)  # 6. a sample
    trainer.ddl_model_card = model_card(
        **trainer.card_inputs, num_parameters=model.num_parameters(), steps=trainer.state.global_step,
        metrics=metrics, loss_curve=curve, sample=sample, prompt=prompt)
    with saving_into(out, "the model card"):
        trainer.create_model_card()
        finish_output_dir(out)  # everything is saved: the folder is a finished run
    if training_args.push_to_hub:
        trainer.push_to_hub(commit_message="End of training")
    val = metrics.get("eval_loss")
    print(f"\nsaved {out} in {time.time() - start:.0f}s: {metrics['tokens_seen']:,} tokens seen; final train loss "
          f"{metrics['final_train_loss']}; validation loss {val if val is None else f'{val:.4f}'} (perplexity "
          f"{metrics.get('eval_perplexity', float('nan')):.2f})")
    print(f"\n--- sample from {out} via pipeline('text-generation') ---\n{sample}")


def run_record(data_args, data_info, tokenizer) -> tuple[dict, str]:
    """What this run trains on, for its checkpoints (`DDLRunRecord`) and a resume's check: the data (its source, the
    content of its local files) and the tokenizer's digest."""
    files = {split: path for split, path in (("train", data_args.train_file),
                                             ("validation", data_args.validation_file)) if path}
    held_out_by = data_info["held_out_by"]
    split = {held_out_by: getattr(data_args, held_out_by)} if held_out_by else {}
    return data_record(data_info["name"], files, data_args.text_column, split), tokenizer_digest(tokenizer)


def cli(argv: list[str]) -> int:
    """Run `main`; a user mistake becomes one `train.py: error: ...` line on stderr and exit status 2."""
    failed = True
    try:
        main(argv)
        failed = False
    except UsageError as err:
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except StrictDataclassError as err:  # a DDLConfig built from a checkpoint's config.json is invalid
        print(f"train.py: error: {config_error_message(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"train.py: interrupted; {interruption_note()}", file=sys.stderr)
        return 130
    finally:
        release_output_dirs(failed)
        end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
