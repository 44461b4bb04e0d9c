"""`DDLTrainingArguments` and `DDLTrainer`: transformers' own, with their flags checked as they are parsed, DDL's
model card, Hub pushes of revisions that load, a stop at the first non-finite loss or gradient norm, exact evaluation
losses and a fast resume of streamed data.
"""

import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, HubStrategy, SaveStrategy
from transformers.utils import PushInProgress, logging

from .card import model_card, shareable_arguments
from .launch import import_deepspeed_only_when_used
from .outputs import UsageError, check_seeds, write_text
from .resume import tokens_seen
from .runs import last_complete_checkpoint, saving_into
from .streaming import StreamPosition, save_position, saved_position


logger = logging.get_logger(__name__)


@dataclass
class DDLTrainingArguments(TrainingArguments):
    """`TrainingArguments`, with the values it accepts and Trainer then misuses refused in one line before anything
    is written: a batch of 0 or no accumulation (a late DataLoader error, a division by zero), a negative or
    non-finite learning rate, weight decay, epsilon or clipping norm (AdamW's traceback; a negative norm silently
    turns clipping off), betas outside [0, 1), seeds numpy refuses, a length Trainer reads as epochs, and Hub
    strategies that push pickles. Plus the output folder's one rule (`ddl_tools.outputs`)."""

    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Allow writing into a non-empty --output_dir (otherwise: error, or resume)."}
    )

    def __post_init__(self):
        super().__post_init__()
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} {getattr(self, name)}: must be at least 1.")
        for name in ("learning_rate", "weight_decay", "adam_epsilon", "max_grad_norm"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                what = " (0: no clipping)" if name == "max_grad_norm" else ""
                raise UsageError(f"--{name} {getattr(self, name)}: must be a number >= 0{what}.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UsageError(f"--{name} {getattr(self, name)}: must be in [0, 1).")
        for name in ("seed", "data_seed"):
            check_seeds(f"--{name}", [getattr(self, name)])
        if self.max_steps == 0 or self.max_steps < -1:  # (Trainer reads -3 as "train --num_train_epochs epochs")
            raise UsageError(f"--max_steps {self.max_steps}: give a positive number of optimizer steps, or -1 to "
                             "train for --num_train_epochs epochs.")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            raise UsageError(f"--num_train_epochs {self.num_train_epochs}: must be above 0 (or give --max_steps).")
        if self.push_to_hub and self.hub_strategy in (HubStrategy.CHECKPOINT, HubStrategy.ALL_CHECKPOINTS):
            raise UsageError(f"--hub_strategy {self.hub_strategy.value} would push Trainer's checkpoint folders "
                             "(optimizer and RNG states are pickles); train.py pushes loadable models only. Use "
                             "--hub_strategy every_save or end, and resume from the local checkpoint-* folders.")


class StepClock(TrainerCallback):
    """The steady training rate, which the whole run's (`train_runtime`) is not: that one also counts compilation
    (`--torch_compile`), the first steps' one-time work, evaluations and checkpoints. Here: the wall time between
    consecutive optimizer steps of this `train()` call, after its first `warmup` steps, leaving out every interval in
    which an evaluation or a save ran. Host time, without a device synchronisation: on a GPU the launch queue keeps it
    within about a step of the device's. `steady()`: (seconds, steps), (0, 0) when no step qualified."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.seconds, self.steps, self.seen, self.last, self.disturbed = 0.0, 0, 0, None, False

    def on_train_begin(self, args, state, control, **kwargs):
        self.seconds, self.steps, self.seen, self.last, self.disturbed = 0.0, 0, 0, None, False

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seen += 1
        if self.last is not None and self.seen > self.warmup and not self.disturbed:
            self.seconds, self.steps = self.seconds + now - self.last, self.steps + 1
        self.last, self.disturbed = now, False

    def on_evaluate(self, args, state, control, **kwargs):
        self.disturbed = True

    def on_save(self, args, state, control, **kwargs):
        self.disturbed = True

    def steady(self) -> tuple[float, int]:
        return self.seconds, self.steps


class TrainingDiverged(UsageError):
    """The loss or the gradient norm stopped being finite: the run stops at that step, saving nothing of it."""


class DDLTrainer(Trainer):
    """`Trainer` that writes our model card instead of the generic one, pushes to the Hub revisions that load, and
    stops a run that diverges.

    `ddl_model_card` is the final card (set after training). `card_inputs` (`model_card`'s description of the run:
    everything but `num_parameters`, `steps`, `metrics` and the results) lets every in-progress push carry a card.
    Pushes go through `ddl_tools.hub`: each revision holds the weights, config, the model's .py files, tokenizer and
    card, and no checkpoint, log or pickle. The output folder itself gets the training arguments as JSON instead of
    Trainer's pickled `training_args.bin` (the `checkpoint-*` folders, which resume a run, keep theirs).

    Divergence: Trainer's `logging_nan_inf_filter` replaces a NaN loss by the mean of the losses logged since the
    last log (0 right after one), so a run whose weights have become NaN logs `loss 0`, saves NaN checkpoints and a
    NaN final model, and reports success. Here every optimizer step's gradient norm (the same on every process) and
    raw losses are checked before anything of that step is logged, evaluated or saved; a non-finite one raises
    `TrainingDiverged`, leaving the last good checkpoint the newest. Steps that fp16's loss scaler skips (an overflow
    it handles by itself) are not checked. A checkpoint save that fails (a full disk) is one line (`saving_into`;
    `save_failure_note` says what to do, default: how to continue the run).

    Streamed data: each checkpoint records where the stream stood (`ddl_tools.streaming`), and a resume from such a
    checkpoint starts the stream there instead of drawing and discarding everything consumed before it.

    Three private methods are overridden, where no public hook reaches what is needed: `_maybe_log_save_evaluate`
    receives the step's gradient norm (Trainer's, over every process and shard; a callback would compute it again,
    with collectives of its own), `_save_checkpoint` is the one call around a checkpoint's whole save (`on_save` comes
    after it), and `_push_from_checkpoint` is Trainer's push at each save, which copies a fixed list of files (not the
    model's .py files) and uploads a pickle.
    """

    ddl_model_card: str | None = None
    card_inputs: dict | None = None
    save_failure_note: str | None = None
    _losses_finite = None  # whether this optimizer step's raw losses were all finite (a tensor: no synchronisation)
    _stream: StreamPosition | None = None  # the streamed training set as this train() call draws it
    _stream_resume: dict | None = None  # where the checkpoint this train() call resumes left its stream
    _eval_sums: list | None = None  # during an evaluation: (summed token loss, tokens) of every row evaluated

    def __init__(self, *args, **kwargs):
        import_deepspeed_only_when_used()
        super().__init__(*args, **kwargs)

    def _streams(self) -> bool:
        """Whether the training set is streamed through this process (not worker processes): its position can be
        kept."""
        from datasets import IterableDataset

        return isinstance(self.train_dataset, IterableDataset) and self.args.dataloader_num_workers == 0

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        self._stream_resume = None
        if isinstance(resume_from_checkpoint, str) and self._streams():
            with open(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
                step = json.load(f)["global_step"]
            per_step = self.get_total_train_batch_size(self.args)
            self._stream_resume = saved_position(resume_from_checkpoint, step, per_step)
        skip = self.args.ignore_data_skip
        if self._stream_resume is not None:
            self.args.ignore_data_skip = True  # the stream starts where the checkpoint stopped: nothing to skip
            if self.is_world_process_zero():
                print(f"resuming the stream where {os.path.basename(resume_from_checkpoint)} left it (after "
                      f"{self._stream_resume['drawn']:,} blocks), without reading them again")
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.ignore_data_skip = skip

    def get_train_dataloader(self):
        if not self._streams():
            return super().get_train_dataloader()
        dataset, resume = self.train_dataset, self._stream_resume
        if resume is not None:
            dataset.load_state_dict(resume["state"])
        self._stream = StreamPosition(dataset, drawn=resume["drawn"] if resume else 0,
                                      every=self.get_total_train_batch_size(self.args))
        self.train_dataset = self._stream
        try:
            return super().get_train_dataloader()
        finally:
            self.train_dataset = dataset

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix="eval"):
        """Trainer's loop, with the loss the mean over every evaluated token. Trainer's own weighs each batch's mean
        by the full batch size (a shorter last batch counts as a full one) and, over several processes, counts in
        the rows accelerate repeats to even out the last batch: one process and two gave different losses."""
        self._eval_sums = []
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
            if self._eval_sums:
                total, tokens = torch.cat(self._eval_sums).double().sum(0).tolist()
                output.metrics[f"{metric_key_prefix}_loss"] = total / tokens
        finally:
            self._eval_sums = None
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """A loss-only step also keeps each row's summed token loss and token count, gathered over the processes
        without the rows repeated to even out the last batch (`evaluation_loop`)."""
        labels, language_model = inputs.get("labels"), self.accelerator.unwrap_model(model)
        if (self._eval_sums is None or not prediction_loss_only or labels is None or "shift_labels" in inputs
                or not language_model.can_generate()):  # (a causal LM's shifted token loss; not a task head's)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        labels = inputs["labels"]
        with torch.no_grad(), self.compute_loss_context_manager():
            logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        loss_function = language_model.loss_function  # transformers' causal LM loss
        sums = torch.stack([loss_function(logits[i:i + 1], labels[i:i + 1], vocab_size=logits.shape[-1],
                                          num_items_in_batch=1) for i in range(len(labels))])
        tokens = (labels[:, 1:] != -100).sum(-1)
        rows = torch.stack([sums.float(), tokens.float()], -1)
        self._eval_sums.append(self.accelerator.gather_for_metrics(rows).cpu())
        return (sums.sum() / tokens.sum()).detach(), None, None

    def create_model_card(self, *args, **kwargs):
        if self.ddl_model_card is None:
            return super().create_model_card(*args, **kwargs)
        if self.is_world_process_zero():
            write_text(os.path.join(self.args.output_dir, "README.md"), self.ddl_model_card)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        # Never a push of its own (Trainer pushes a "Model save" commit here): the final push follows the card.
        super().save_model(output_dir, _internal_call=True)
        folder = output_dir or self.args.output_dir
        if self.args.should_save and os.path.abspath(folder) == os.path.abspath(self.args.output_dir):
            pickled = os.path.join(folder, TRAINING_ARGS_NAME)
            if os.path.exists(pickled):
                os.remove(pickled)
            write_text(os.path.join(folder, "training_args.json"), shareable_arguments(self.args))

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        finite = torch.isfinite(loss).all()
        self._losses_finite = finite if self._losses_finite is None else self._losses_finite & finite
        return loss

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, *args, **kwargs):
        self._stop_if_diverged(grad_norm)
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    def _stop_if_diverged(self, grad_norm) -> None:
        losses_finite, self._losses_finite = self._losses_finite, None
        if self.accelerator.optimizer_step_was_skipped:
            return
        norm = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        if norm is not None and not math.isfinite(norm):
            what = f"gradient norm is {norm}"
        elif losses_finite is not None and not bool(losses_finite):
            what = "loss is not finite"
        else:
            return
        latest = last_complete_checkpoint(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None
        kept = (f"the last checkpoint before it, {os.path.basename(latest)}, is kept" if latest
                else "no checkpoint was saved before it")
        resume = (f" (--resume_from_checkpoint true would continue from {os.path.basename(latest)} with its own "
                  "learning-rate schedule)" if latest else "")
        # the schedule's peak: a resumed run's is its checkpoint's, whatever --learning_rate says
        peak = self.optimizer.param_groups[0].get("initial_lr", self.args.learning_rate)
        raise TrainingDiverged(
            f"training diverged at step {self.state.global_step}: the {what}; the run stopped there and saved nothing "
            f"of that step ({kept}). Lower --learning_rate (the run's peak is {peak:g}) or lengthen --warmup_steps, "
            f"and start over with --overwrite_output_dir or in another --output_dir{resume}.")

    def _save_checkpoint(self, model, trial):
        with saving_into(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}",
                         self.save_failure_note):
            super()._save_checkpoint(model, trial)
            step = self.state.global_step
            if self._stream is not None and self.args.should_save:
                checkpoint = os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
                if not save_position(self._stream, checkpoint, step, self._stream.every):
                    logger.warning("The stream's position at step %d is no longer known: a resume from %s will "
                                   "read the stream again up to it.", step, checkpoint)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Trainer's push at each save (`hub_strategy` every_save), as a revision that loads (see `ddl_tools.hub`)."""
        from .hub import push_folder, stage_checkpoint

        if not self.is_world_process_zero() or self.args.hub_strategy == HubStrategy.END:
            return
        if not self.args.hub_always_push and self.push_in_progress is not None and not self.push_in_progress.is_done():
            return  # as Trainer: skip this save while the previous push still uploads
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        if not stage_checkpoint(checkpoint_folder, self.args.output_dir):
            logger.warning("Not pushing step %d: the checkpoint holds a LoRA adapter, not a model that loads on its "
                           "own; the merged model is pushed at the end.", self.state.global_step)
            return
        if self.card_inputs is not None:
            write_text(os.path.join(self.args.output_dir, "README.md"), self.progress_card())
        at = (f"step {self.state.global_step}" if self.args.save_strategy == SaveStrategy.STEPS
              else f"epoch {int(self.state.epoch)}")
        job = push_folder(self.args.output_dir, self.hub_model_id, f"Training in progress, {at}",
                          token=self.args.hub_token, revision=self.args.hub_revision, blocking=False)
        self.push_in_progress = PushInProgress([job])

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs):
        """Trainer's final push: save, write the card, upload the output folder through `ddl_tools.hub`."""
        from .hub import push_folder

        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        self.create_model_card(**kwargs)
        self._finish_current_push()
        return push_folder(self.args.output_dir, self.hub_model_id, commit_message, token=token,
                           revision=revision or self.args.hub_revision, blocking=blocking)

    def progress_card(self) -> str:
        """The model card of a revision pushed during training: the run as described so far, the last logged
        losses."""
        state, inputs = self.state, self.card_inputs
        last = {key: [e[key] for e in state.log_history if key in e] for key in ("loss", "eval_loss")}
        metrics = {"tokens_seen": tokens_seen(state, self.args, inputs["block_size"]),
                   "final_train_loss": (last["loss"] or [None])[-1], "eval_loss": (last["eval_loss"] or [None])[-1]}
        total = f" of {state.max_steps:,}" if state.max_steps > 0 else ""
        status = (f"**Training in progress** (step {state.global_step:,}{total}): the weights of that step and the "
                  "losses logged so far.")
        return model_card(**inputs, num_parameters=self.model.num_parameters(), steps=state.global_step,
                          metrics=metrics, loss_curve=None, status=status)


__all__ = ["DDLTrainer", "DDLTrainingArguments", "TrainingDiverged"]
