import os
import sys

import pytest
import torch


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Nothing in the tests may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels run through its interpreter on CPU; the flag must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# DDL_TEST_DEVICE=cuda runs the model and kernel tests (those marked `device`: a module's `pytestmark =
# pytest.mark.device`) on that device: torch's default device is set for each of them, so every tensor and model they
# build lives there. The other tests (scripts, packaging) run on CPU only and are skipped under the switch; without a
# GPU the device tests are skipped. CI leaves it unset (CPU).
TEST_DEVICE = os.environ.get("DDL_TEST_DEVICE", "cpu").strip().lower() or "cpu"
if TEST_DEVICE.startswith("cuda"):
    torch.backends.cuda.matmul.allow_tf32 = False  # the specs are compared in true fp32
    torch.backends.cudnn.allow_tf32 = False
torch.set_num_threads(1)  # tiny models: threads only add synchronisation (and fight over 2 cores)

def pytest_configure(config):
    config.addinivalue_line("markers", "device: runs on DDL_TEST_DEVICE (model and kernel tests)")


def pytest_collection_modifyitems(config, items):
    if TEST_DEVICE == "cpu":
        return
    no_device = TEST_DEVICE.startswith("cuda") and not torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("device") is None:
            item.add_marker(pytest.mark.skip(reason=f"runs on CPU only (DDL_TEST_DEVICE={TEST_DEVICE})"))
        elif no_device:
            item.add_marker(pytest.mark.skip(reason=f"DDL_TEST_DEVICE={TEST_DEVICE} but torch sees no GPU"))


@pytest.fixture(autouse=True)
def _on_test_device(request):
    """The device tests build their tensors and models on DDL_TEST_DEVICE (the default device while they run)."""
    if TEST_DEVICE == "cpu" or request.node.get_closest_marker("device") is None:
        yield
        return
    torch.set_default_device(TEST_DEVICE)
    try:
        yield
    finally:
        torch.set_default_device(None)


def seeded(seed):
    """A random generator on the test device, seeded."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


TINY = dict(
    vocab_size=99,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(**overrides):
    from ddl import DDLConfig

    return DDLConfig(**{**TINY, **overrides})


def trained_looking(model, scale=0.1):
    """Moves every DDL parameter off its (symmetric) initial value, so that tests see gates, values and convolutions
    that vary across tokens and channels (a leak through a token convolution is invisible at identity taps)."""
    from ddl_tools.loading import ddl_branch_parameters

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in ddl_branch_parameters(model):
            params[name].add_(scale * torch.randn_like(params[name]))
    return model


def tiny_tokenizer(text=None, vocab_size=300):
    """A byte-level BPE trained in-process (no Hub access) by train.py's own trainer, left padding, as it saves it."""
    from ddl_tools.data import train_bpe_tokenizer

    text = text or ("To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 20)
    return train_bpe_tokenizer([text.splitlines()], vocab_size)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(params=["cpu-kernel", "pytorch"])
def cpu_kernel_on_or_off(request, monkeypatch):
    """Runs a test twice: with ddl_kernels' C++ CPU kernels (where they build) and with them off, so that the PyTorch
    paths, which machines without a compiler (or without ddl_kernels) run, stay tested on CPU too."""
    from ddl_kernels import build

    if TEST_DEVICE != "cpu" and request.param == "cpu-kernel":
        pytest.skip("the C++ kernels serve CPU tensors only")
    if request.param == "pytorch":
        monkeypatch.setattr(build, "_ops", False)
    elif build.kernels() is None:
        pytest.skip("the C++ CPU kernels could not be built here: the 'pytorch' case covers this machine")
    return request.param


def count_calls(monkeypatch, op, which):
    """A list that gets an entry for every call of `op` (a `ddl.ops` operation) that ddl_kernels' C++ kernel served
    (`which="C++"`) or that the specification computed (`which="PyTorch"`), for as long as the test runs."""
    from ddl import modeling_ddl, ops

    calls, cpu = [], torch.device("cpu")
    kernel = ops.kernel(op, "auto", cpu)  # (also fills ops' table of installed kernels)
    if which == "C++":
        if kernel is not None:
            def counted(*args, **kwargs):
                out = kernel(*args, **kwargs)
                return out if out is None else calls.append(1) or out

            monkeypatch.setitem(ops._installed[op], "cpu", counted)
        return calls
    dispatched, served = getattr(ops, op), []
    if kernel is not None:
        monkeypatch.setitem(ops._installed[op], "cpu", lambda *args, **kwargs: (
            lambda out: out if out is None else served.append(1) or out)(kernel(*args, **kwargs)))

    def counted(*args, **kwargs):
        before = len(served)
        out = dispatched(*args, **kwargs)
        if len(served) == before:
            calls.append(1)
        return out

    monkeypatch.setattr(modeling_ddl, op, counted)  # (where the model calls it)
    return calls


def triton_on_cpu(monkeypatch, operations=("delta_residual", "token_readout", "token_conv", "folded_conv_read")):
    """ddl_kernels' Triton kernels for `operations`, run through Triton's CPU interpreter (TRITON_INTERPRET=1) as if
    these CPU tensors were on a GPU: put in `ddl.ops`' table for the CPU, where the C++ kernels would be (not fp64,
    as on CUDA), for as long as the test runs."""
    pytest.importorskip("triton")
    from ddl import ops
    from ddl_kernels import fallible, serving
    from ddl_kernels.readout.triton import conv_step, fold, readout_and_norm, token_window, window_step
    from ddl_kernels.readout.triton import window_step_norm
    from ddl_kernels.residual import triton as residual

    runs = {"delta_residual": ("Triton residual seam", residual.run),
            "delta_residual_readout": ("Triton residual seam", residual.run),
            "delta_residual_readout_norm": ("Triton residual seam", residual.run),
            "token_readout": ("Triton readout", lambda x, taps: token_window(x, taps, read=True)),
            "token_readout_norm": ("Triton readout and RMSNorm", readout_and_norm),
            "token_conv": ("Triton EC", lambda x, taps: token_window(x, taps, read=False)),
            "folded_conv_read": ("Triton CC fold", fold), "window_step": ("Triton window step", window_step),
            "window_step_norm": ("Triton window step and RMSNorm", window_step_norm),
            "conv_step": ("Triton EC step", conv_step)}
    ops.kernel("delta_residual", "auto", torch.device("cpu"))  # (fills ops' table of installed kernels)
    for op in runs:  # (the C++ kernels' place, where there is one: these, or none; each with its readout or norm too)
        name, run = runs[op]
        served = op in operations or any(op.startswith(f"{base}_") and base in operations
                                         for base in ("delta_residual", "token_readout", "window_step"))
        cpu = serving(lambda *args, **kwargs: args[0].dtype != torch.float64, fallible(name, run)) if served else (
            lambda *args, **kwargs: None)
        monkeypatch.setitem(ops._installed, op, {**ops._installed.get(op, {}), "cpu": cpu})


def assert_same_loss_and_gradients(models, ids, loss_atol=1e-6, grad_rtol=1e-5, grad_atol=1e-6):
    """`models`: {"reference": ..., "fused": ...}; the training loss and every parameter's gradient agree."""
    losses = {impl: m(ids, labels=ids).loss for impl, m in models.items()}
    torch.testing.assert_close(losses["fused"], losses["reference"], rtol=0, atol=loss_atol)
    for loss in losses.values():
        loss.backward()
    reference = dict(models["reference"].named_parameters())
    for name, param in models["fused"].named_parameters():
        torch.testing.assert_close(param.grad, reference[name].grad, rtol=grad_rtol, atol=grad_atol, msg=name)


def run_cli(cli, args, capsys):
    """A script's `cli(args)` run in process (an interpreter start costs seconds), as `python script.py` runs it:
    its exit status (argparse's own errors exit through SystemExit) and what it wrote to stderr."""
    try:
        status = cli(args)
    except SystemExit as exit_:
        status = exit_.code
    return status, capsys.readouterr().err


def in_hf_cache(folder, hf_home, repo_id, revision="0" * 40):
    """A copy of `folder` laid out as a Hub download leaves it: hub/models--org--name/{refs/main, snapshots/<rev>/},
    for loading by Hub id with HF_HUB_OFFLINE=1."""
    repo = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
