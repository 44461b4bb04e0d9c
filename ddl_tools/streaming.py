"""A streamed training set that a resume continues at once, where its checkpoint stopped.

Trainer resumes a run by drawing, and throwing away, every batch the checkpoint had consumed: for a streamed set that
is reading and tokenising all of it again, which grows with the run (a day before the first step of a long one).
`datasets.IterableDataset` can instead say where it is (`state_dict()`: the shard and row it reads, and what its
tokenising and packing maps have yielded of their current input batch) and start again from there
(`load_state_dict`), reading only the current map batch again.

The state must be the one after the examples the checkpoint's steps consumed, not after those the data loader has
drawn ahead: `StreamPosition` keeps the dataset's state after each recent step's last example it handed out; the
checkpoint at step s records the one after s x (examples per step) examples. Saved as `STREAM_POSITION` in the
checkpoint; a checkpoint without it (an older run, or a data loader in worker processes, where the main process cannot
see the dataset's state) resumes the slow way, Trainer's.
"""

import collections
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
                self._states[self.drawn] = self.dataset.state_dict()  # (a copy: datasets returns one)
                if len(self._states) > self.keep:
                    self._states.popitem(last=False)
            yield example

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

    def state_after(self, drawn: int) -> dict | None:
        return self._states.get(drawn)


def save_position(stream: StreamPosition, checkpoint: str, step: int, per_step: int) -> bool:
    """Write where the stream stood after `step` optimizer steps of `per_step` examples into `checkpoint` (the process
    that reads a stream draws every process's batches: Trainer's total train batch size); False if that state is no
    longer kept (then the checkpoint resumes the slow way)."""
    drawn = step * per_step
    state = stream.state_after(drawn)
    if state is None:
        return False
    temporary = os.path.join(checkpoint, f".{STREAM_POSITION}.ddl-tmp")
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump({"step": step, "drawn": drawn, "state": state}, f)
    os.replace(temporary, os.path.join(checkpoint, STREAM_POSITION))
    return True


def saved_position(checkpoint: str, step: int, per_step: int) -> dict | None:
    """The stream's position saved in `checkpoint`, if it is there, whole, and the one of its step and batch layout
    (None: the checkpoint resumes the slow way, Trainer's)."""
    path = os.path.join(checkpoint, STREAM_POSITION)
    try:
        with open(path, encoding="utf-8") as f:
            position = json.load(f)
    except (OSError, ValueError):  # (absent, or damaged from outside: a save writes it whole or not at all)
        return None
    if (not isinstance(position, dict) or position.get("step") != step or position.get("drawn") != step * per_step
            or not isinstance(position.get("state"), dict)):
        return None
    return position


__all__ = ["STREAM_POSITION", "StreamPosition", "save_position", "saved_position"]
