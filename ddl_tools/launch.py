"""How a script was launched: refuse launches that would not do what they say, before anything is written.

- FSDP on CPU. `accelerate` turns a process group into FSDP only on GPUs (or another accelerator); on CPU it keeps
  `MULTI_CPU`, which is DDP: every process holds all parameters. (PyTorch's `fully_shard` itself shards a DDL model
  over gloo on CPU, but `Trainer` reaches it only through `accelerate`.)
- Processes that are not one job. `accelerate launch` with a GPU config on a machine without GPUs (and `torchrun`
  where no process group forms) starts N processes that each train alone, into the same output folder.
- A precision the flags contradict. Under `accelerate launch` the run's precision has two sources: the launch's
  mixed_precision (which accelerate autocasts to, and writes into a DeepSpeed config) and Trainer's --bf16 / --fp16.
  train.py's default follows the launch; flags that contradict it are refused where they would not be followed
  (DeepSpeed fails at the first step on any difference; elsewhere `--bf16 false` quietly autocasts to the launch's
  precision while the run's record says otherwise). Other launch precisions (fp8) are accelerate's to handle.

(Two runs into one folder, two shells or a rerun while the first still trains, are refused by the output folder's
lock: `ddl_tools.runs.claim_output_dir`.) eval.py and bench.py take a `--device`: `device_problem` says in one line
why one cannot run here.
"""

import contextlib
import os
import sys

from .outputs import UsageError
from .presets import check_ddl_environment


def device_problem(value, script) -> str | None:
    """Why `--device value` cannot run `script` on this machine (not a device, no such CUDA device, another kind), or
    None."""
    import torch

    try:
        device = torch.device(value)
    except RuntimeError:
        return f"--device {value!r} is not a device; pass cpu, cuda or cuda:N."
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {value}: this machine has no CUDA device; pass --device cpu (or leave it out)."
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        return f"--device {value}: there are {torch.cuda.device_count()} CUDA device(s), numbered from 0."
    if device.type not in ("cpu", "cuda"):
        return f"--device {value}: {script} runs on cpu or cuda."
    return None


def launched_processes() -> int:
    """How many processes the launcher (torchrun, accelerate launch, mpirun) says this job has."""
    for name in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def launcher_precision() -> str | None:
    """The mixed precision `accelerate launch` asked for ("no", "bf16", "fp16", ...); None when not launched by it."""
    return os.environ.get("ACCELERATE_MIXED_PRECISION") or None


def import_deepspeed_only_when_used() -> None:
    """accelerate's `unwrap_model`, which Trainer calls on every model, imports DeepSpeed wherever it is installed only
    to tell a DeepSpeed engine from other wrappers, and DeepSpeed's import prints an accelerator warning ("Setting
    accelerator to CPU ...") into runs that never asked for it. No engine exists before DeepSpeed is imported (a
    DeepSpeed launch imports it as its process group forms), so accelerate looks for one only once it is."""
    from accelerate.utils import other

    other.is_deepspeed_available = lambda: "deepspeed" in sys.modules


def launched_on_cpu() -> bool:
    """Whether `accelerate launch --cpu` started this process: TrainingArguments then runs on the CPU, but its bf16
    check asks for --use_cpu."""
    return os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("true", "1", "yes")


@contextlib.contextmanager
def outside_zero3():
    """Load models in this process alone: under DeepSpeed ZeRO-3, `from_pretrained` partitions the weights it loads
    over every process (`zero.Init`), a collective the other processes never join once training is over."""
    from transformers.integrations import deepspeed

    if not deepspeed.is_deepspeed_zero3_enabled():
        yield
        return
    active = deepspeed._hf_deepspeed_config_weak_ref()  # (the config accelerate keeps alive for the run)
    deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed.set_hf_deepspeed_config(active)


def end_process_group() -> None:
    """Destroys this process's process group, if one formed, before the interpreter exits (PyTorch asks for it at the
    end of main): a gloo group left to interpreter teardown can abort the process (SIGABRT, "terminate called without
    an active exception") after its work is done, failing a finished run under torchrun. The finished run's Trainer
    and its DDP-wrapped model are collected first: left in reference cycles, they would hold the group past
    `destroy_process_group` (which only drops PyTorch's own references) until teardown otherwise."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def fsdp_requested(training_args) -> bool:
    """An accelerate FSDP config (`accelerate launch --config_file configs/fsdp.yaml`) or Trainer's `--fsdp`."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" or bool(training_args.fsdp)


def check_launch(training_args) -> None:
    """Refuse (one line) a launch that would not shard as asked, whose processes would not form one job, or whose
    precision flags contradict the launcher's; and an invalid DDL environment variable."""
    check_ddl_environment()
    launched = launched_processes()
    if fsdp_requested(training_args) and training_args.device.type == "cpu":
        raise UsageError(
            "FSDP was requested (accelerate FSDP config or --fsdp), but on CPU accelerate runs plain DDP instead "
            "(every process would hold all parameters): it builds FSDP only on GPUs. On CPU run DDP: accelerate "
            "launch --config_file configs/ddp_cpu.yaml train.py --use_cpu (or torchrun --nproc_per_node N)."
        )
    if launched > 1 and training_args.world_size == 1:
        why = (" (without --use_cpu, accelerate forms a process group only over GPUs, and there are none here)"
               if training_args.device.type == "cpu" else "")
        fix = ("On CPU pass --use_cpu to train.py (DDP over gloo; see configs/README.md)."
               if training_args.device.type == "cpu" else "Check the launch config against configs/README.md.")
        raise UsageError(f"Started as one of {launched} processes, but they did not form one job{why}, so each would "
                         f"train alone into the same output folder. {fix}")
    launcher, flags = launcher_precision(), "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else "no"
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" or bool(training_args.deepspeed)
    # (Trainer follows a flag that asks for bf16/fp16, and the launch when none does; DeepSpeed wants them equal)
    if launcher in ("no", "bf16", "fp16") and launcher != flags and (deepspeed or flags == "no"):
        on_cpu = (" (on a machine without GPUs, train.py follows a bf16 launch with --use_cpu, which accelerate launch "
                  "--cpu gives)" if launcher == "bf16" and training_args.device.type == "cpu"
                  and not getattr(training_args, "use_cpu", True) else "")
        raise UsageError(
            f"The launch asks for mixed precision {launcher!r} (the accelerate config's mixed_precision, or accelerate "
            f"launch --mixed_precision) but train.py's flags for {flags!r}: make them agree, e.g. accelerate launch "
            f"--mixed_precision {flags} ..., or leave --bf16/--fp16 unset to follow the launch{on_cpu}."
        )


__all__ = ["check_launch", "device_problem", "end_process_group", "fsdp_requested", "import_deepspeed_only_when_used",
           "launched_on_cpu", "launched_processes", "launcher_precision", "outside_zero3"]
