"""Multi-process launches that would not do what they say are refused with one line, before anything is written.

`accelerate launch --config_file configs/fsdp.yaml` on CPU used to run plain DDP (with `--use_cpu`) or two
independent trainings into one folder (without), both with exit status 0; and nothing stopped two runs from writing
one output folder at the same time.
"""

import json
import os
import subprocess
import sys

import pytest

from test_train import ROOT, TINY_RUN, TRAIN, env, text_file, tiny  # noqa: F401 (text_file: a fixture)


def accelerate_launch(config, *args, timeout=240):
    """`accelerate launch` through this interpreter (its console script may belong to another environment)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", os.path.join(ROOT, "configs", config),
           "--num_processes", "2", "--main_process_port", "29541", TRAIN, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)


LAUNCHES = {
    "fsdp-config-use-cpu": ("fsdp.yaml", ["--use_cpu"], "FSDP was requested"),  # ran DDP, exit 0
    "fsdp-config": ("fsdp.yaml", [], "FSDP was requested"),  # ran 2 independent trainings, exit 0
    "gpu-ddp-config": ("ddp.yaml", [], "did not form one job"),  # ran 2 independent trainings, exit 0
}


@pytest.mark.parametrize("case", list(LAUNCHES))
def test_launch_that_would_not_do_what_it_says_is_refused(case, tmp_path, text_file):  # noqa: F811
    config, extra, message = LAUNCHES[case]
    out = tmp_path / "out"
    args = [a for a in tiny(out, text_file, "--max_steps", "2") if a != "--use_cpu"] + extra
    proc = accelerate_launch(config, *args)
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error:")]
    assert lines and all(message in line for line in lines), proc.stderr[-3000:]
    assert f'{TRAIN}", line' not in proc.stderr  # no traceback through train.py (the launcher reports the exit)
    assert not out.exists()  # nothing written


def test_an_accelerate_cpu_launch_in_bf16_trains_in_bf16(tmp_path, text_file):  # noqa: F811
    """`accelerate launch --mixed_precision bf16 --cpu train.py ...` was refused with a line asking to leave
    --bf16/--fp16 unset, which they were: --bf16 needs --use_cpu on a machine without GPUs, and accelerate's --cpu is
    now read as it."""
    out = tmp_path / "out"
    args = [a for a in tiny(out, text_file, "--max_steps", "1", "--eval_steps", "1", "--save_steps", "1")
            if a != "--use_cpu"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--mixed_precision", "bf16", "--cpu", TRAIN, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    arguments = json.loads((out / "training_args.json").read_text())
    assert arguments["bf16"] is True and arguments["use_cpu"] is True


def test_refused_run_leaves_no_folder_behind(tmp_path, capsys):
    """The output folder's claim creates it first; a run stopped by a bad input removes it again when it is empty."""
    import train

    out = tmp_path / "never"
    status = train.cli(["--output_dir", str(out), "--resume_from_checkpoint", "true", *TINY_RUN])
    assert status == 2 and "checkpoint-* folder" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("launch, flags, deepspeed, refused", [
    ("bf16", "no", False, True),  # accelerate would autocast to bf16 although --bf16 false
    ("no", "bf16", False, False),  # Trainer follows --bf16 true: the run is what its flags say
    ("no", "bf16", True, True),  # DeepSpeed's config and Trainer's must agree
    ("bf16", "bf16", True, False),
    ("fp8", "no", False, False),  # not a precision Trainer's flags name: accelerate's to handle
])
def test_launch_precision_against_the_flags(launch, flags, deepspeed, refused, monkeypatch):
    from types import SimpleNamespace

    from ddl_tools.launch import check_launch
    from ddl_tools.outputs import UsageError

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launch)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", str(deepspeed).lower())
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = SimpleNamespace(bf16=flags == "bf16", fp16=False, deepspeed=None, fsdp="", world_size=1,
                           device=SimpleNamespace(type="cpu"))
    if refused:
        with pytest.raises(UsageError, match="mixed precision"):
            check_launch(args)
    else:
        check_launch(args)


def test_a_run_ends_its_process_group_before_the_interpreter_does(tmp_path, capsys):
    """PyTorch asks each process to destroy its process group at the end of main: a gloo group left to interpreter
    teardown can abort a finished torchrun worker (SIGABRT, "terminate called without an active exception"), which
    failed a DDP test once. train.py ends it however the run ends (here, a refused one)."""
    import torch.distributed as dist

    import train

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        status = train.cli(["--output_dir", str(tmp_path / "never"), "--resume_from_checkpoint", "true", *TINY_RUN])
        assert status == 2 and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
