"""Fine-tune a Deep Delta Learning (DDL) model as a text classifier with 🤗 Trainer, scored with 🤗 `evaluate`.

The task ships with the corpus (no download): the genre of a passage of a few speeches of Shakespeare, comedy,
history or tragedy as the First Folio files each play, with six whole plays held out for evaluation
(ddl_tools/tasks.py). Accuracy and macro-F1 come from the project's own `evaluate` modules in metrics/, loaded by
path, offline. The output folder is a complete checkpoint: `AutoModelForSequenceClassification.from_pretrained(folder,
trust_remote_code=True)` or `pipeline("text-classification", model=folder, trust_remote_code=True)`.

    python train.py                                                              # pretrain a tiny DDL LM, then
    python train_classifier.py --model_name_or_path outputs/ddl-tiny-shakespeare  # fine-tune it as a classifier
    python train_classifier.py                    # the same classifier from a fresh (untrained) tiny DDL, for contrast
    python train_classifier.py --config_overrides ddl_value_channels=1,ddl_embed_conv=false   # another variant

Every `TrainingArguments` flag works (--num_train_epochs, --learning_rate, --per_device_train_batch_size, ...) but
--resume_from_checkpoint: a run is short, and is rerun rather than resumed.
"""

import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import evaluate
import numpy as np
from datasets import Dataset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, HfArgumentParser,
                          set_seed)
from transformers.utils import logging

import ddl  # noqa: F401  (registers the DDL Auto classes and the code files saved with checkpoints)
from ddl import DDLForSequenceClassification
from ddl_tools.data import prepare_tokenizer_for_generation, train_bpe_tokenizer
from ddl_tools.launch import check_launch
from ddl_tools.loading import check_weights, checkpoint_config, load_pretrained
from ddl_tools.outputs import UsageError, write_json
from ddl_tools.presets import PRESETS, parse_config_overrides, parsed_arguments, preset_config
from ddl_tools.runs import claim_results_dir, release_output_dirs, run_cli, saving_into
from ddl_tools.tasks import GENRE_LABELS, genre_splits
from ddl_tools.training import DDLTrainer, DDLTrainingArguments


# The metric modules ship with this script (the Hub's would be downloaded): found next to it, whatever the cwd.
METRICS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metrics")


@dataclass
class ClassifierArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A DDL checkpoint (folder or Hub id), e.g. train.py's output. Default: a "
                                        "fresh model from --preset."}
    )
    preset: str = field(default="tiny", metadata={"help": "Size of a fresh model.", "choices": sorted(PRESETS)})
    config_overrides: str | None = field(
        default=None, metadata={"help": "DDLConfig fields of a fresh model, e.g. 'ddl_value_channels=1,"
                                        "ddl_embed_conv=false'."}
    )
    vocab_size: int = field(default=4096, metadata={"help": "A fresh model's BPE, trained on the training passages."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow a checkpoint's tokenizer remote code."})
    max_chars: int = field(default=600, metadata={"help": "Longest passage, in characters (whole speeches)."})
    max_length: int = field(default=256, metadata={"help": "Tokens per passage (longer ones are truncated)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on this many passages at most."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on this many passages at most."})


def parse_args(argv):
    parser = HfArgumentParser((ClassifierArguments, DDLTrainingArguments))
    parser.set_defaults(
        output_dir=os.path.join("outputs", "ddl-genre-classifier"), num_train_epochs=1, learning_rate=5e-4,
        weight_decay=0.1, warmup_steps=0.05, lr_scheduler_type="cosine", per_device_train_batch_size=16,
        per_device_eval_batch_size=32, eval_strategy="no", save_strategy="no", logging_steps=20, report_to="none",
    )
    return parsed_arguments(parser, argv)


def check_checkpoint(args):
    """Fail fast, before any data work, on a checkpoint that is not DDL, weights that are damaged or do not fit its
    config, or flags that cannot apply to it."""
    source = args.model_name_or_path
    if source is None:
        return
    if args.config_overrides:
        raise UsageError("--config_overrides shapes a fresh model; a checkpoint keeps its own architecture. Drop it.")
    config = checkpoint_config(source, "--model_name_or_path", fix=" Train a DDL language model with train.py.")
    check_weights(source, DDLForSequenceClassification, config, "--model_name_or_path")


def load_task(args, seed):
    """The genre passages as 🤗 datasets (subsampled at random, with the run's seed, when asked)."""
    for name in ("max_train_samples", "max_eval_samples", "max_length"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be a positive integer, got {getattr(args, name)}.")
    try:
        splits = genre_splits(args.max_chars)
    except ValueError as err:
        raise UsageError(f"--max_chars: {err}") from err
    data = {}
    for name, limit in (("train", args.max_train_samples), ("validation", args.max_eval_samples)):
        dataset = Dataset.from_dict(splits[name])
        if limit is not None and limit < len(dataset):
            dataset = dataset.shuffle(seed=seed).select(range(limit))
        data[name] = dataset
    return data


def get_tokenizer(args, train):
    if args.model_name_or_path is None:
        return train_bpe_tokenizer([list(train["text"])], args.vocab_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:
        raise UsageError(f"Cannot load a tokenizer from {args.model_name_or_path!r} ({err}).") from err
    return prepare_tokenizer_for_generation(tokenizer)  # a pad token (the eos token if the tokenizer has none)


def build_model(args, tokenizer):
    """A DDL checkpoint with a fresh classification head, or a fresh DDL classifier from the preset."""
    labels = dict(num_labels=len(GENRE_LABELS), id2label=dict(enumerate(GENRE_LABELS)),
                  label2id={label: i for i, label in enumerate(GENRE_LABELS)}, pad_token_id=tokenizer.pad_token_id)
    if args.model_name_or_path is None:
        ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        config = preset_config(args.preset, len(tokenizer), parse_config_overrides(args.config_overrides),
                               **labels, **ids)
        return DDLForSequenceClassification(config)
    model = load_pretrained(AutoModelForSequenceClassification, args.model_name_or_path, "--model_name_or_path",
                            **labels)
    if len(tokenizer) > model.config.vocab_size:
        raise UsageError(f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size}; the checkpoint's own tokenizer must come with it.")
    return model


def compute_metrics_with(accuracy, f1):
    def compute_metrics(prediction):
        predictions = np.argmax(prediction.predictions, axis=-1)
        references = prediction.label_ids
        return {**accuracy.compute(predictions=predictions, references=references),
                "f1_macro": f1.compute(predictions=predictions, references=references, average="macro")["f1"]}

    return compute_metrics


def main(argv):
    args, training_args = parse_args(argv)
    if training_args.should_log:
        logging.set_verbosity_warning()
    if training_args.resume_from_checkpoint is not None:  # (Trainer's flag, which only train() reads: it was ignored)
        raise UsageError("--resume_from_checkpoint: a train_classifier.py run is not resumed (it writes its classifier "
                         "once, at the end); rerun the command, with --overwrite_output_dir where its folder is not "
                         "empty.")
    check_launch(training_args)
    check_checkpoint(args)
    if args.model_name_or_path is None:  # a fresh model's config, checked before any data work
        preset_config(args.preset, args.vocab_size, parse_config_overrides(args.config_overrides))
    # the output folder made this run's (one run at a time; never written over without --overwrite_output_dir)
    claim_results_dir(training_args.output_dir, training_args.overwrite_output_dir, training_args.process_index == 0)
    set_seed(training_args.seed)
    data = load_task(args, training_args.seed)
    tokenizer = get_tokenizer(args, data["train"])
    model = build_model(args, tokenizer)
    accuracy = evaluate.load(os.path.join(METRICS, "accuracy"))
    f1 = evaluate.load(os.path.join(METRICS, "f1"))

    def tokenize(batch):
        return tokenizer(batch["text"], truncation=True, max_length=args.max_length)

    encoded = {name: split.map(tokenize, batched=True, remove_columns=["text", "work"])
               for name, split in data.items()}
    # DDLTrainer: the training arguments saved as JSON, not as Trainer's pickle (training_args.bin); a diverging
    # run stops with one line; a save that fails is one line
    trainer = DDLTrainer(model=model, args=training_args, train_dataset=encoded["train"],
                         eval_dataset=encoded["validation"], processing_class=tokenizer,
                         data_collator=DataCollatorWithPadding(tokenizer),
                         compute_metrics=compute_metrics_with(accuracy, f1))
    out = training_args.output_dir
    trainer.save_failure_note = "then rerun the same command with --overwrite_output_dir."
    train_result = trainer.train()
    metrics = {**train_result.metrics, **trainer.evaluate()}
    counts = Counter(data["validation"]["label"])
    metrics["eval_majority_accuracy"] = max(counts.values()) / len(data["validation"])
    with saving_into(out, "the classifier", trainer.save_failure_note):
        trainer.save_model()  # weights, config (labels, auto_map), the model's .py files, tokenizer
        if not trainer.is_world_process_zero():
            return
        write_json(os.path.join(out, "all_results.json"), metrics)
    release_output_dirs()
    if training_args.push_to_hub:
        trainer.push_to_hub(commit_message="End of training")
    works = sorted(set(data["validation"]["work"]))
    print(f"\ngenre of {len(data['validation'])} passages from {len(works)} held-out plays ({', '.join(works)}): "
          f"accuracy {metrics['eval_accuracy']:.3f}, macro-F1 {metrics['eval_f1_macro']:.3f} (always guessing the "
          f"most frequent genre: accuracy {metrics['eval_majority_accuracy']:.3f}); trained on "
          f"{len(data['train'])} passages; saved {out}")


def cli(argv) -> int:
    """Run `main`; a user mistake becomes one `train_classifier.py: error: ...` line on stderr and exit status 2."""
    return run_cli(main, argv, "train_classifier.py", lambda: "rerun the command (with --overwrite_output_dir where "
                                                               "its output folder kept checkpoints).")


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
