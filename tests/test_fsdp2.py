"""FSDP2 (`fully_shard` on each decoder layer and the model, two CPU processes over gloo under torchrun): training
steps give one process's losses, and both ways of saving the sharded model load back with that process's weights:
the full state dict (`get_model_state_dict`) through `save_pretrained` / `from_pretrained`, and a distributed
checkpoint (DCP) turned into a state dict for `from_pretrained`. For d_v=1, CC+EC and TC+EC.

Each process takes half of the batch; FSDP averages the gradients over the processes, which is the full batch's
gradient when every row has as many tokens (it does here), so the losses and weights must match one process's.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, tiny_config, trained_looking
from ddl import DDLForCausalLM


VARIANTS = {
    "dv1": dict(ddl_value_channels=1),
    "cc-ec": dict(ddl_value_channels=4, ddl_compressor="cc"),
    "tc-ec": dict(ddl_value_channels=4, ddl_compressor="tc"),
}
STEPS = 3
LR = 0.02

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from ddl import DDLForCausalLM

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
steps, lr = int(sys.argv[1]), float(sys.argv[2])
for folder in sys.argv[3:]:
    model = DDLForCausalLM.from_pretrained(folder)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    batches = torch.tensor(json.load(open(os.path.join(folder, "batches.json"))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        mine = batch.chunk(world)[rank]
        loss = model(mine, labels=mine).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(folder, "dcp"))
    dist.barrier()
    if rank == 0:
        DDLForCausalLM.from_pretrained(folder).save_pretrained(os.path.join(folder, "full"), state_dict=full)
        dcp_to_torch_save(os.path.join(folder, "dcp"), os.path.join(folder, "dcp.pt"))
        json.dump(losses, open(os.path.join(folder, "losses.json"), "w"))
dist.destroy_process_group()
"""


def _torchrun():
    path = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(path):
        pytest.skip("torchrun is not installed")
    return path


def test_fully_shard_training_and_its_saves_equal_one_process(tmp_path):
    torchrun = _torchrun()
    expected, folders = {}, []
    for name, overrides in VARIANTS.items():
        torch.manual_seed(0)
        model = trained_looking(DDLForCausalLM(tiny_config(**overrides)), scale=0.3)
        folder = tmp_path / name
        model.save_pretrained(folder)
        batches = torch.randint(3, TINY["vocab_size"], (STEPS, 4, 10), generator=torch.Generator().manual_seed(1))
        (folder / "batches.json").write_text(json.dumps(batches.tolist()))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for batch in batches:
            loss = model(batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        expected[name] = (losses, model.eval())
        folders.append(str(folder))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script), str(STEPS), str(LR),
                           *folders], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ids = torch.randint(3, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    for name, folder in zip(VARIANTS, folders):
        losses, model = expected[name]
        with open(os.path.join(folder, "losses.json")) as f:
            assert json.load(f) == pytest.approx(losses, rel=1e-5), name
        with torch.no_grad():
            logits = model(ids).logits
            saved = DDLForCausalLM.from_pretrained(os.path.join(folder, "full")).eval()
            torch.testing.assert_close(saved(ids).logits, logits, rtol=1e-4, atol=1e-5, msg=f"{name}: full")
            state = torch.load(os.path.join(folder, "dcp.pt"), weights_only=True)["model"]
            from_dcp = DDLForCausalLM.from_pretrained(None, config=model.config, state_dict=state).eval()
            torch.testing.assert_close(from_dcp(ids).logits, logits, rtol=1e-4, atol=1e-5, msg=f"{name}: DCP")
