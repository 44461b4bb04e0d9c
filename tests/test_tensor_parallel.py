"""Tensor parallel (`from_pretrained(..., tp_plan="auto")` under torchrun, two CPU processes over gloo): one training
step gives one process's loss and every gradient, for d_v=1, CC+EC and TC+EC with QK-norm (every preset has it).

DDLConfig's plan is Llama's plus QK-norm's per-head norms: the query and key heads are split over the ranks, so each
rank sees its heads' part of those norms' gradients, which must be summed (`replicated_with_grad_allreduce`, as
Qwen3's plan has it); without it those gradients are wrong and the ranks' weights drift apart after the optimizer
step, silently. DDL's own parameters read the full (replicated) residual state and need no entry.
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

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
import ddl  # noqa: F401
from transformers import AutoModelForCausalLM, DistributedConfig

for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(tp_plan="auto"))
    ids = torch.tensor(json.load(open(os.path.join(folder, "ids.json"))))
    loss = model(ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.tolist()
    if dist.get_rank() == 0:
        json.dump({"loss": loss.item(), "grads": grads}, open(os.path.join(folder, "tp.json"), "w"))
"""


def test_one_tensor_parallel_training_step_equals_one_process(tmp_path):
    if shutil.which("torchrun") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable),
                                                                            "torchrun")):
        pytest.skip("torchrun is not installed")
    expected, folders = {}, []
    for name, overrides in VARIANTS.items():
        torch.manual_seed(0)
        model = trained_looking(DDLForCausalLM(tiny_config(qk_norm=True, **overrides)), scale=0.3)
        with torch.no_grad():  # norms off their ones, so that their gradients differ per head
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.add_(0.2 * torch.randn_like(param))
        folder = tmp_path / name
        model.save_pretrained(folder)
        ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
        (folder / "ids.json").write_text(json.dumps(ids.tolist()))
        loss = model(ids, labels=ids).loss
        loss.backward()
        expected[name] = (loss.item(), {n: p.grad for n, p in model.named_parameters()})
        folders.append(str(folder))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script), *folders],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    for name, folder in zip(VARIANTS, folders):
        with open(os.path.join(folder, "tp.json")) as f:
            got = json.load(f)
        loss, grads = expected[name]
        assert got["loss"] == pytest.approx(loss, rel=1e-6), name
        for param_name, grad in grads.items():
            torch.testing.assert_close(torch.tensor(got["grads"][param_name]), grad, rtol=1e-4, atol=1e-6,
                                       msg=f"{name}: {param_name}")
