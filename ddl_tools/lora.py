"""LoRA fine-tuning of DDL models with PEFT (an optional extra: `pip install "ddl[lora]"`).

PEFT picks default LoRA targets from the model types it knows; "ddl" is not one of them, so a bare `LoraConfig()`
fails ("Please specify `target_modules`"). DDL keeps Llama's module names, so the targets are Llama's: the attention
and MLP projections (`LORA_TARGET_MODULES`). DDL's own parameters (the gates and values of every sublayer, the
compressors, EC, the readout) are not `nn.Linear` layers LoRA could adapt; they are few, and `ddl_branch_modules`
names their modules for PEFT's `modules_to_save`, which trains a copy of them in full and saves it with the adapter.

    from peft import LoraConfig, get_peft_model
    from ddl_tools.lora import LORA_TARGET_MODULES, ddl_branch_modules
    config = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGET_MODULES,
                        modules_to_save=ddl_branch_modules(model))
    model = get_peft_model(model, config)

`train.py --lora` does this (`lora_config`, `add_lora`) and at the end saves the adapter and the merged model
(`save_adapter_and_merge`).
"""

import os

import torch

from .outputs import UsageError
from .loading import ddl_branch_parameters


LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_FOLDER = "adapter"  # inside the output folder, next to the merged model


def ddl_branch_modules(model) -> list[str]:
    """The modules holding DDL's own parameters (`ddl_branch_parameters`), as PEFT's `modules_to_save` matches
    them (by the end of a module's name): a module's last name (`attn_delta`) where no other module's name ends the
    same way, else its full name."""
    owners = sorted({name.rpartition(".")[0] for name in ddl_branch_parameters(model)})
    others = [name for name, _ in model.named_modules() if name not in owners]
    names = []
    for owner in owners:
        short = owner.rpartition(".")[2]
        unique = not any(other.endswith(short) for other in others)
        name = short if unique else owner
        if name not in names:
            names.append(name)
    return names


def lora_config(model, r: int = 16, alpha: int = 32, dropout: float = 0.0, target_modules=None,
                train_ddl_branch: bool = True, from_llama: bool = False):
    """A causal-LM `LoraConfig` for a DDL model: LoRA on `target_modules` (default `LORA_TARGET_MODULES`), and DDL's
    own parameters trained in full unless `train_ddl_branch` is False (then they stay frozen). A model just built
    from a Llama (`from_llama`) also trains its QK-norm weights in full: a Llama has none, so they start at ones."""
    from peft import LoraConfig, TaskType

    fresh = ["q_norm", "k_norm"] if from_llama and model.config.qk_norm else []
    return LoraConfig(task_type=TaskType.CAUSAL_LM, r=r, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=list(target_modules or LORA_TARGET_MODULES),
                      modules_to_save=(ddl_branch_modules(model) + fresh or None) if train_ddl_branch else None)


def check_lora(model_args) -> None:
    """`--lora` adapts a trained model and needs peft: say so in one line before any work."""
    if not (model_args.model_name_or_path or model_args.init_from_llama):
        raise UsageError("--lora adapts a trained model: give --model_name_or_path (a DDL checkpoint) or "
                         "--init_from_llama (a Llama; the fresh DDL branch then trains in full).")
    try:
        import peft  # noqa: F401
    except ImportError as err:
        raise UsageError(f"--lora needs peft ({err}); install it with: pip install 'ddl[lora]'.") from err


def add_lora(model, model_args, verbose: bool = True):
    """Wrap `model` for LoRA training as the `--lora*` flags say; prints what trains (when `verbose`)."""
    from peft import get_peft_model

    targets = [t.strip() for t in model_args.lora_target_modules.split(",")] if model_args.lora_target_modules else None
    matches = {t: [m for n, m in model.named_modules() if n == t or n.endswith("." + t)] for t in targets or ()}
    missing = [t for t, found in matches.items() if not found]  # (PEFT fails only when no target matches at all)
    other = {t: type(found[0]).__name__ for t, found in matches.items()
             if found and not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in found)}
    if missing or other:  # (PEFT: a long message, or, for DDL's own modules, training them in full as if adapted)
        linear = sorted({n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        own = [t for t in other if any(t == n or n.endswith("." + t) for n in ddl_branch_modules(model))]
        kinds = ", ".join(sorted(set(other.values())))
        trained = f"; DDL's own {own} train in full with --lora_train_ddl_branch (the default)" if own else ""
        found = [f"this model has no module named {missing}"] * bool(missing) + [
            f"{sorted(other)}: not a linear layer or embedding LoRA can adapt ({kinds}){trained}"] * bool(other)
        raise UsageError(f"--lora_target_modules: {'; '.join(found)}; its linear layers: {linear}.")
    config = lora_config(model, model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout, targets,
                         model_args.lora_train_ddl_branch, from_llama=bool(model_args.init_from_llama))
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as err:  # e.g. a target module the model does not have
        raise UsageError(f"--lora: {err}") from err
    base = model_args.model_name_or_path
    if base and os.path.isdir(base):  # each checkpoint's adapter_config names its base, which a relative path would
        # name from wherever eval.py or PEFT later runs
        peft_model.peft_config[peft_model.active_adapter].base_model_name_or_path = os.path.realpath(base)
    if not verbose:
        return peft_model
    trainable, total = peft_model.get_nb_trainable_parameters()
    print(f"LoRA: r {config.r}, alpha {config.lora_alpha} on {sorted(config.target_modules)}; DDL branch "
          f"{'trained in full: ' + str(sorted(config.modules_to_save)) if config.modules_to_save else 'frozen'}; "
          f"{trainable:,} of {total:,} parameters train")
    return peft_model


def check_lora_checkpoint(model, checkpoint: str) -> None:
    """A `--lora` run resumed from `checkpoint` continues its adapter: `model` (the base and `add_lora`, as this
    command's flags build them) must hold the same LoRA and the same DDL modules trained in full, tensor for tensor.
    Otherwise parts of the adapter would be left out silently (a fresh QK-norm without --qk_norm) or fail to load
    (another --lora_r): one line naming what differs."""
    from peft import PeftConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    saved, config = PeftConfig.from_pretrained(checkpoint), model.peft_config["default"]
    differ = [f"{flag} {getattr(config, field)} (it has {getattr(saved, field)})"
              for field, flag in (("r", "--lora_r"), ("lora_alpha", "--lora_alpha"))
              if getattr(config, field) != getattr(saved, field)]
    for field, what in (("target_modules", "--lora_target_modules"),
                        ("modules_to_save", "the DDL modules trained in full (--lora_train_ddl_branch, --ddl_*)")):
        if set(getattr(config, field) or ()) != set(getattr(saved, field) or ()):
            differ.append(f"{what}: {sorted(getattr(config, field) or ())} (it has {sorted(getattr(saved, field) or ())})")
    with safe_open(os.path.join(checkpoint, "adapter_model.safetensors"), "pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    built = {key: tuple(value.shape) for key, value in get_peft_model_state_dict(model).items()}
    if not differ and shapes != built:
        names = sorted(key for key in shapes.keys() | built.keys() if shapes.get(key) != built.get(key))
        differ.append(f"its tensors do not fit the model these flags build ({names[0]}, {len(names)} in all; "
                      "--ddl_* / --config_overrides as the run's)")
    if differ:
        raise UsageError(f"--resume_from_checkpoint {checkpoint!r} continues its LoRA adapter, but {'; '.join(differ)}. "
                         "Resume with the run's own --lora_* and model flags, or start a new run in another "
                         "--output_dir.")


def load_lora_weights(model, checkpoint: str) -> None:
    """The adapter (and DDL branch) a `--lora` run saved in `checkpoint`, loaded into `model` (which
    `check_lora_checkpoint` found to fit): a run resumed at its last step finishes with these weights."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model, load_file(os.path.join(checkpoint, "adapter_model.safetensors")))


def describe_lora(model_args) -> str | None:
    """The model card's line on the fine-tuning (None without --lora)."""
    if not model_args.lora:
        return None
    targets = model_args.lora_target_modules or ",".join(LORA_TARGET_MODULES)
    branch = "trained in full" if model_args.lora_train_ddl_branch else "frozen"
    return (f"LoRA (r {model_args.lora_r}, alpha {model_args.lora_alpha}) on {targets}, DDL's own parameters "
            f"{branch}; merged into these weights (the adapter alone is in `{ADAPTER_FOLDER}/`)")


def save_adapter_and_merge(trainer):
    """After LoRA training: the adapter (PEFT's format) into `<output_dir>/adapter`, then the LoRA deltas and the
    trained DDL branch merged into the model, which becomes what the trainer saves and pushes. Returns it."""
    peft_model = trainer.model
    if trainer.is_world_process_zero():
        peft_model.save_pretrained(os.path.join(trainer.args.output_dir, ADAPTER_FOLDER))
    merged = peft_model.merge_and_unload()
    trainer.model = trainer.model_wrapped = merged
    return merged


__all__ = ["ADAPTER_FOLDER", "LORA_TARGET_MODULES", "add_lora", "check_lora", "ddl_branch_modules", "describe_lora",
           "check_lora_checkpoint", "load_lora_weights", "lora_config",
           "save_adapter_and_merge"]
