"""Accuracy as an `evaluate` module that loads offline: `evaluate.load("path/to/metrics/accuracy")`.

The project's own module (the Hub's `accuracy` would be downloaded at load time): the fraction of predictions equal to
their reference, with scikit-learn's `accuracy_score` semantics (`normalize`, `sample_weight`), in numpy only.
"""

import datasets
import evaluate
import numpy as np


_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all predictions:
    accuracy = (number of predictions equal to their reference) / (number of predictions)
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels, as many as predictions.
    normalize (`bool`, defaults to True): False returns the (weighted) number of correct predictions instead.
    sample_weight (`list` of `float`, optional): one weight per prediction.
Returns:
    accuracy (`float`): in [0, 1] (or a count when normalize=False).
Example:
    >>> accuracy = evaluate.load("metrics/accuracy")
    >>> accuracy.compute(predictions=[0, 1, 2, 1], references=[0, 2, 2, 1])
    {'accuracy': 0.75}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        correct = np.asarray(predictions) == np.asarray(references)
        weights = np.ones(len(correct)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if len(weights) != len(correct):
            raise ValueError(f"sample_weight has {len(weights)} entries for {len(correct)} predictions.")
        total = float(np.sum(weights * correct))
        if not normalize:
            return {"accuracy": total}
        if np.sum(weights) == 0:
            raise ValueError("accuracy of no predictions (or all sample weights zero) is undefined.")
        return {"accuracy": total / float(np.sum(weights))}
