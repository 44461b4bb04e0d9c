"""F1 as an `evaluate` module that loads offline: `evaluate.load("path/to/metrics/f1")`.

The project's own module (the Hub's `f1` would be downloaded at load time), with scikit-learn's `f1_score` semantics
for single-label classification (`average` binary | micro | macro | weighted | None, `labels`, `pos_label`,
`sample_weight`; a label with no prediction and no reference scores 0), in numpy only.
"""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = """
The F1 score is the harmonic mean of precision and recall, per label:
    F1 = 2 * TP / (2 * TP + FP + FN)
For several labels, `average` combines them: "macro" (unweighted mean over labels), "weighted" (mean weighted by
each label's number of references), "micro" (one F1 from the summed TP, FP, FN), or None (one F1 per label).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels, as many as predictions.
    average (`str` or None, defaults to "binary"): "binary" (the F1 of `pos_label`; needs at most two labels),
        "micro", "macro", "weighted", or None.
    labels (`list` of `int`, optional): the labels to score (and their order for average=None); default: every
        label in predictions or references, sorted.
    pos_label (`int`, defaults to 1): the positive label for average="binary".
    sample_weight (`list` of `float`, optional): one weight per prediction.
Returns:
    f1 (`float`, or a `list` of `float` when average=None): in [0, 1].
Example:
    >>> f1 = evaluate.load("metrics/f1")
    >>> f1.compute(predictions=[0, 1, 2, 1], references=[0, 2, 2, 1], average="macro")
    {'f1': 0.7777777777777777}
"""

AVERAGES = ("binary", "micro", "macro", "weighted", None)


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, average="binary", labels=None, pos_label=1, sample_weight=None):
        if average not in AVERAGES:
            raise ValueError(f"average must be one of {AVERAGES}, got {average!r}.")
        predictions, references = np.asarray(predictions), np.asarray(references)
        weights = np.ones(len(predictions)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if len(weights) != len(predictions):
            raise ValueError(f"sample_weight has {len(weights)} entries for {len(predictions)} predictions.")
        present = np.union1d(predictions, references)
        if average == "binary":
            if len(present) > 2:
                raise ValueError(f"average='binary' needs at most two labels, got {present.tolist()}; choose "
                                 "average='macro', 'micro' or 'weighted'.")
            labels = [pos_label]
        elif labels is None:
            labels = present
        labels = np.asarray(labels)
        # (L, N) one-hot of each label against the predictions and the references
        predicted = predictions[None, :] == labels[:, None]
        actual = references[None, :] == labels[:, None]
        tp = np.sum(weights * (predicted & actual), axis=1)
        fp = np.sum(weights * (predicted & ~actual), axis=1)
        fn = np.sum(weights * (~predicted & actual), axis=1)
        if average == "micro":
            return {"f1": _f1(tp.sum(), fp.sum(), fn.sum())}
        scores = np.array([_f1(*counts) for counts in zip(tp, fp, fn)])
        if average is None:
            return {"f1": scores.tolist()}
        if average == "weighted":
            support = tp + fn
            return {"f1": float(np.sum(scores * support) / np.sum(support)) if np.sum(support) > 0 else 0.0}
        return {"f1": float(np.mean(scores))}  # binary (one label) or macro


def _f1(tp, fp, fn) -> float:
    denominator = 2 * tp + fp + fn
    return float(2 * tp / denominator) if denominator > 0 else 0.0
