"""One rank of `test_rebuild.test_two_ddp_ranks_...`: a TC+EC model with its states rebuilt in backward, wrapped in
DistributedDataParallel (gloo), trained on its half of the batch; rank 0 saves the loss and the all-reduced
gradients. Run as `python ddp_rebuild_worker.py RANK WORLD_SIZE STORE_FILE OUT_FILE`."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_rebuild import _batch, _model  # noqa: E402

from ddl import rebuild  # noqa: E402


def main(rank, world_size, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        calls = []
        original = rebuild.rebuild_state
        rebuild.rebuild_state = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
        model = DistributedDataParallel(_model({"ddl_compressor": "tc"}, "auto", "on", torch.float64))
        ids, _ = _batch("plain")
        part = ids.chunk(world_size)[rank]
        loss = model(part, labels=part, use_cache=False).loss
        loss.backward()  # DDP averages the ranks' gradients: the full batch's, rows of equal length
        losses = [torch.zeros((), dtype=loss.dtype) for _ in range(world_size)]
        dist.all_gather(losses, loss.detach().reshape(()))
        if rank == 0:
            grads = {name.removeprefix("module."): p.grad for name, p in model.named_parameters()}
            torch.save({"loss": torch.stack(losses).mean(), "grads": grads, "rebuilt": len(calls)}, out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
