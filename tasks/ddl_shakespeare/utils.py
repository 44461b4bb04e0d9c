"""Loader of the `ddl_shakespeare` task: the JSONL next to this file, through the `json` dataset builder."""

import os

import datasets


DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddl_shakespeare.jsonl")


def load(**task_metadata) -> datasets.DatasetDict:
    """{"train": few-shot items, "test": scored items}, split by the `split` column.

    lm-eval calls this with the task's `metadata` (and any `--metadata` given on its command line) as keyword
    arguments; none of them changes the data.
    """
    rows = datasets.load_dataset("json", data_files={"items": DATA_FILE})["items"]
    return datasets.DatasetDict(
        {split: rows.filter(lambda row, s=split: row["split"] == s) for split in ("train", "test")}
    )
