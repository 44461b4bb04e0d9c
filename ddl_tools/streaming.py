"""A streamed training set that a resume continues at once, where its checkpoint stopped.

Trainer resumes a run by drawing, and throwing away, every batch the checkpoint had consumed: for a streamed set that
is reading and tokenising all of it again, which grows with the run (a day before the first step of a long one).
`datasets.IterableDataset` can instead say where it is (`state_dict()`: the shard and row it reads, and what its
tokenising and packing maps have yielded of their current input batch) and start again from there
(`load_state_dict`), reading only the current map batch again.

The state must be the one after the examples the checkpoint's steps consumed, not after those the data loader has
drawn ahead: `StreamPosition` keeps the dataset's state after each recent step's last example it handed out; the checkpoint at
step s records the one after s x (examples per step) examples. Saved as `STREAM_POSITION` in the checkpoint; a
checkpoint without it (an older run, or a data loader in worker processes, where the main process cannot see the
dataset's state) resumes the slow way, Trainer's.
"""

import collections
import copy
import json
import os

import torch


STREAM_POSITION = "ddl_stream_position.json"


class StreamPosition(torch.utils.data.IterableDataset):
    """`dataset` (a `datasets.IterableDataset`) as the training loop draws it, with the dataset's state after every
    `every`-th example (a step's worth), for the last `keep` of those: `state_after(n)` is where the dataset stood
    after its n-th example. `drawn` counts from the run's start, so a resumed stream goes on counting from its
    checkpoint's. (Only a step's last example can be a checkpoint's: copying the state after every example cost a
    few percent of drawing it.)"""

    def __init__(self, dataset, drawn: int = 0, every: int = 1, keep: int = 8):
        self.dataset, self.drawn, self.every, self.keep = dataset, drawn, every, keep
        self._states = collections.OrderedDict()

    def __iter__(self):
        for example in self.dataset:
            self.drawn += 1
            if self.drawn % self.every == 0:
                self._states[self.drawn] = copy.deepcopy(self.dataset.state_dict())
                if len(self._states) > self.keep:
                    self._states.popitem(last=False)
            yield example

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_after(self, drawn: int) -> dict | None:
        return self._states.get(drawn)


def examples_per_step(args) -> int:
    """Examples the process that reads the stream draws per optimizer step: accelerate has one process read a stream
    for all (or every process read all of it and keep its share), so all processes' batches."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


def save_position(stream: StreamPosition, checkpoint: str, step: int, args) -> bool:
    """Write where the stream stood after `step` optimizer steps into `checkpoint`; False if that state is no longer
    kept (then the checkpoint resumes the slow way)."""
    drawn = step * examples_per_step(args)
    state = stream.state_after(drawn)
    if state is None:
        return False
    temporary = os.path.join(checkpoint, f".{STREAM_POSITION}.ddl-tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"step": step, "drawn": drawn, "state": state}, f)
    os.replace(temporary, os.path.join(checkpoint, STREAM_POSITION))
    return True


def saved_position(checkpoint: str, step: int, args) -> dict | None:
    """The stream's position saved in `checkpoint`, if it is there and is the one of its step and batch layout."""
    path = os.path.join(checkpoint, STREAM_POSITION)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        position = json.load(f)
    if position.get("step") != step or position.get("drawn") != step * examples_per_step(args):
        return None
    return position


__all__ = ["STREAM_POSITION", "StreamPosition", "examples_per_step", "save_position", "saved_position"]
