"""What a checkpoint ships, run as a Hub user runs it: `from_pretrained(folder, trust_remote_code=True)` in a fresh
process that cannot import this project. The shipped code is the model (configuration, modeling, specifications,
packing, the dispatcher) and nothing else: loading it, a training step and `generate` start no process
and write nothing outside the Hugging Face cache (Python's audit hooks watch), and give the in-repo model's numbers.
With ddl_kernels installed the same remote code runs its kernels; with another interface version, the
specifications and one warning.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, TINY, tiny_config, trained_looking
from ddl import DDLForCausalLM


# The most a checkpoint's code may hold (it is what a reviewer reads before trusting it): a fixed budget, never moved to
# fit the code.
SHIPPED_LINES = 1500

VARIANTS = {
    "dv1": dict(ddl_value_channels=1),
    "cc-ec": dict(ddl_value_channels=4, ddl_compressor="cc"),
    "tc-ec": dict(ddl_value_channels=4, ddl_compressor="tc"),
}

# What both sides run: one fused-AdamW step, a no-grad forward, greedy decoding.
STEP = """
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
loss = model(ids, labels=ids).loss
loss.backward()
optimizer.step()
with torch.no_grad():
    logits = model(ids).logits
generated = model.generate(ids[:, :3], max_new_tokens=4, do_sample=False, pad_token_id=0)
"""

# Runs in the fresh process: the audit hook records every process started and every file opened for writing
# outside the HF cache, from the moment the hook is installed (before transformers is imported).
USER = r"""
import json, os, sys
hf_home, blocked = os.environ["HF_HOME"], sys.argv[3].split(",")
events = []

def audit(event, args):
    if event in ("subprocess.Popen", "os.system", "os.posix_spawn", "os.exec", "os.fork", "os.spawn"):
        events.append(f"{event}: {args[0]!r}")
    elif event == "open" and isinstance(args[0], (str, bytes)):
        path, mode, flags = os.fsdecode(args[0]), args[1] or "", args[2] or 0
        writes = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and not os.path.realpath(path).startswith(os.path.realpath(hf_home)) and path != os.devnull:
            frame = sys._getframe(1)
            while frame and frame.f_code.co_name != "_get_default_tempdir":  # (tempfile's probe: made and deleted)
                frame = frame.f_back
            if frame is None:
                events.append(f"write: {path}")

sys.addaudithook(audit)
for name in blocked:
    sys.modules[name] = None  # `import <name>` raises ImportError: nothing of the project is importable
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging
logging.set_verbosity_info()

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
ops = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".ops"]
ops.kernel("delta_residual", "auto", torch.device("cpu"))  # (fills its table of installed kernels)
used = {op: sorted(devices) for op, devices in ops._installed.items()}
calls = {}
for op, devices in ops._installed.items():
    def counted(run, name):
        return lambda *args, **kwargs: (lambda out: out if out is None else calls.__setitem__(
            name, calls.get(name, 0) + 1) or out)(run(*args, **kwargs))
    for device, run in devices.items():
        devices[device] = counted(run, f"{op} on {device}")
ids = torch.tensor(json.loads(sys.argv[2]))
""" + STEP + r"""
print("RESULT " + json.dumps({"loss": loss.item(), "logits": logits.tolist(), "generated": generated.tolist(),
                              "events": events, "registries": used, "calls": calls}))
"""


def _in_repo(model, ids):
    """What the fresh process computes (`STEP`), with the in-repo model and the same (PyTorch) paths."""
    names = {"torch": torch, "model": model, "ids": ids}
    exec(STEP, names)
    return names["loss"].item(), names["logits"], names["generated"]


def _run_user(folder, ids, tmp_path, blocked, extra_env=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    env.update(HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1",
               **(extra_env or {}))
    done = subprocess.run([sys.executable, "-c", USER, str(folder), json.dumps(ids.tolist()), ",".join(blocked)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), done.stderr


def _saved(variant, tmp_path):
    torch.manual_seed(0)
    model = trained_looking(DDLForCausalLM(tiny_config(**VARIANTS[variant])), scale=0.3)
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    model.config.ddl_implementation = "torch"  # (the fresh process has no ddl_kernels: PyTorch paths)
    return model, folder


def test_a_checkpoint_ships_the_model_and_nothing_else(tmp_path):
    """The files a saved folder carries: Python only (no native source, no build supervision), within the budget."""
    DDLForCausalLM(tiny_config()).save_pretrained(tmp_path)
    shipped = sorted(f for f in os.listdir(tmp_path) if f.endswith(".py"))
    assert shipped == ["configuration_ddl.py", "modeling_ddl.py", "ops.py", "packing.py", "reference.py"]
    lines = sum(len((tmp_path / f).read_text().splitlines()) for f in shipped)
    assert lines <= SHIPPED_LINES, f"{lines} lines shipped"
    text = "".join((tmp_path / f).read_text() for f in shipped)
    for word in ("cpp_extension", "subprocess", "load_inline", "#include", "fcntl"):
        assert word not in text, word


@pytest.mark.parametrize("variant", VARIANTS)
def test_remote_code_without_the_project_trains_and_generates_starting_nothing_writing_nothing(variant, tmp_path):
    model, folder = _saved(variant, tmp_path)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    result, stderr = _run_user(folder, ids, tmp_path, ["ddl", "ddl_tools", "ddl_kernels"])
    assert result["events"] == [] and result["registries"] == {}
    assert stderr.count("ddl_kernels package") == 1 and "is not installed" in stderr  # said once
    loss, logits, generated = _in_repo(model, ids)
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    torch.testing.assert_close(torch.tensor(result["logits"]), logits, rtol=1e-5, atol=1e-5)
    assert result["generated"] == generated.tolist()


def test_remote_code_runs_the_installed_kernels(tmp_path):
    """ddl_kernels installed (the project's model package still not importable): the checkpoint's own dispatcher
    finds the C++ kernels and runs them, with the same numbers up to rounding."""
    from ddl_kernels.build import kernels as built

    if built() is None:
        pytest.skip("the C++ CPU kernels could not be built here")
    model, folder = _saved("tc-ec", tmp_path)
    ids = torch.randint(3, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    result, _ = _run_user(folder, ids, tmp_path, ["ddl", "ddl_tools"])
    assert "cpu" in result["registries"]["delta_residual"] and "cpu" in result["registries"]["token_readout"]
    for op in ("delta_residual", "token_readout", "token_conv", "window_step", "conv_step"):
        assert result["calls"].get(f"{op} on cpu", 0) > 0, (op, result["calls"])
    loss, logits, _ = _in_repo(model, ids)
    assert result["loss"] == pytest.approx(loss, rel=1e-5)
    torch.testing.assert_close(torch.tensor(result["logits"]), logits, rtol=1e-4, atol=1e-4)


MISMATCH = r"""
import sys
import ddl_kernels
ddl_kernels.INTERFACE_VERSION += 1  # as if installed from another version of ddl
sys.modules["ddl"] = None
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
ids = torch.arange(3, 11).view(1, 8)
model(ids, labels=ids).loss.backward()
model(ids)
ops = sys.modules[type(model).__module__.rsplit(".", 1)[0] + ".ops"]
print("REGISTRIES", ops._installed)
"""


def test_a_mismatched_kernel_interface_runs_pytorch_with_one_warning(tmp_path):
    _, folder = _saved("cc-ec", tmp_path)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MISMATCH, str(folder)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    names = next(line for line in done.stdout.splitlines() if line.startswith("REGISTRIES"))
    assert names == "REGISTRIES {}"  # (the specifications run)
    assert done.stderr.count("interface version") == 1


OLD_TRANSFORMERS = r"""
import sys
import transformers
transformers.__version__ = "5.17.0"
sys.modules["ddl"] = None
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
"""


def test_an_older_transformers_is_told_which_to_install(tmp_path):
    """A checkpoint loaded with a transformers older than the one its code needs (pyproject's bound) stops with a
    line naming the version to install, not an ImportError from inside the model's imports (as the GPU machine's
    transformers 5.17 gave: no `slice_logits_to_keep`)."""
    from ddl.configuration_ddl import MIN_TRANSFORMERS

    assert f'"transformers>={MIN_TRANSFORMERS},' in open(os.path.join(ROOT, "pyproject.toml")).read()
    _, folder = _saved("dv1", tmp_path)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", OLD_TRANSFORMERS, str(folder)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0
    assert f"DDL needs transformers>={MIN_TRANSFORMERS}, this is 5.17.0" in done.stderr, done.stderr[-3000:]
    assert f"pip install -U 'transformers>={MIN_TRANSFORMERS}'" in done.stderr


def test_the_in_repo_kernels():
    """ddl_kernels lists one implementation per operation and device: C++ for the CPU where it builds (listed
    anyway; it serves nothing unbuilt), Triton for CUDA only where CUDA is; the seam that also makes the next readout
    on the CPU only."""
    import ddl_kernels

    found = ddl_kernels.implementations()
    assert set(found) == {"delta_residual", "delta_residual_readout", "token_readout", "window_step", "token_conv",
                          "conv_step"}
    assert set(found.pop("delta_residual_readout")) == {"cpu"}  # (the C++ seam also makes the next readout)
    assert all(set(devices) == ({"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"})
               for devices in found.values())


EARLIER = ["ddl-cc-ec-3b07340"]  # the default variant saved by ddl 0.2 with its own 11 files (C++ source included)
OLD_CODE = r"""
import json, sys, torch
sys.modules["ddl"] = sys.modules["ddl_kernels"] = None
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__module__.startswith("transformers_modules")
expected = json.load(open(sys.argv[1] + "/expected.json"))
with torch.no_grad():
    logits = model(torch.tensor(expected["input_ids"])).logits
print("MAX", (logits - torch.tensor(expected["logits"])).abs().max().item())
"""


@pytest.mark.parametrize("name", EARLIER)
def test_checkpoints_saved_by_earlier_versions_load_and_give_their_logits(name, tmp_path):
    """With `ddl` installed they load into today's classes (no remote code); by remote code, in a fresh process, they
    run the code they were saved with (its C++ switched off here: a 1-2 min build, not what is tested)."""
    folder = os.path.join(ROOT, "tests", "fixtures", name)
    with open(os.path.join(folder, "expected.json")) as f:
        expected = json.load(f)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(model) is DDLForCausalLM
    with torch.no_grad():
        logits = model(torch.tensor(expected["input_ids"])).logits
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-5)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "DDL_CPU_KERNEL": "0"}
    done = subprocess.run([sys.executable, "-c", OLD_CODE, folder], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("MAX")[-1]) <= 1e-5
