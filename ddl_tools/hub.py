"""Pushing a run to the Hugging Face Hub: every pushed revision loads with `trust_remote_code=True`, carries the model
card, and holds no pickle.

`Trainer`'s own pushes fall short of that: its "Training in progress" commits copy a fixed list of files from the
checkpoint (config, generation config, weights), not the model's `.py` files that the config's `auto_map` points at,
so such a revision does not load; and every commit uploads `training_args.bin` (a pickle). `DDLTrainer` pushes
through `stage_checkpoint` and `push_folder` below instead.

What a revision holds is the output folder minus `HUB_IGNORE_PATTERNS`: the weights, config, generation config, the
model's `.py` files, the tokenizer, the model card (README.md) and, at the end, the loss curve and the run's JSON
files. Left out: Trainer's `checkpoint-*` folders (optimizer, scheduler and RNG states: pickles, several times the
model's size), TensorBoard logs, and any pickle.

A finished output folder is pushed the same way by `python -m ddl_tools.hub FOLDER REPO_ID`.
"""

import argparse
import os
import shutil
import sys

from huggingface_hub.utils import filter_repo_objects


# Glob patterns (fnmatch on paths relative to the folder, as `upload_folder` applies them) of what is never pushed.
HUB_IGNORE_PATTERNS = [
    "_*",  # Trainer's own exclusion (temporary files)
    "checkpoint-*",  # Trainer's checkpoints: optimizer/scheduler/RNG states for resuming, pickles
    "runs/*",  # TensorBoard logs
    "*.bin", "*.pt", "*.pth", "*.pkl", "*.pickle",  # pickles (training_args.bin is one); weights go as safetensors
]


def publishable(names):
    """The relative paths among `names` that a pushed revision holds."""
    return list(filter_repo_objects(names, ignore_patterns=HUB_IGNORE_PATTERNS))


def stage_checkpoint(checkpoint_folder: str, output_dir: str) -> bool:
    """Copy a Trainer checkpoint's model files (weights, config, generation config, the model's .py files,
    tokenizer) into the output folder, which is then pushed; as Trainer does, so that the checkpoint itself may be
    rotated away while the upload runs. False when the checkpoint holds no full model (a LoRA adapter)."""
    names = [n for n in os.listdir(checkpoint_folder) if os.path.isfile(os.path.join(checkpoint_folder, n))]
    if not any(n.endswith(".safetensors") and not n.startswith("adapter_") for n in names):
        return False
    for name in publishable(names):
        if name != "trainer_state.json":  # the run's state is written at the end
            shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(output_dir, name))
    return True


def push_folder(folder: str, repo_id: str, commit_message: str, *, token=None, revision=None, blocking=True):
    """Upload what a revision holds of `folder` (all but `HUB_IGNORE_PATTERNS`) to `repo_id` as one commit."""
    from transformers.utils.hub import hf_api

    return hf_api().upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message, token=token,
                                  revision=revision, run_as_future=not blocking,
                                  ignore_patterns=list(HUB_IGNORE_PATTERNS))  # upload_folder appends to it


def main(argv=None) -> int:
    """`python -m ddl_tools.hub FOLDER REPO_ID`: push a finished train.py output folder as train.py would."""
    parser = argparse.ArgumentParser(prog="python -m ddl_tools.hub", description=main.__doc__)
    parser.add_argument("folder", help="a train.py output folder (or any saved DDL model folder)")
    parser.add_argument("repo_id", help="the Hub repo, e.g. me/ddl-tiny (created if missing)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--commit_message", default="Upload DDL model")
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.folder, "config.json")):
        print(f"python -m ddl_tools.hub: error: {args.folder!r} holds no config.json: not a saved model folder.",
              file=sys.stderr)
        return 2
    from transformers.utils.hub import hf_api

    repo = hf_api().create_repo(args.repo_id, private=args.private, exist_ok=True)
    push_folder(args.folder, repo.repo_id, args.commit_message)
    print(f"pushed {args.folder} to {repo.repo_id}")
    return 0


__all__ = ["HUB_IGNORE_PATTERNS", "publishable", "push_folder", "stage_checkpoint"]


if __name__ == "__main__":
    sys.exit(main())
