"""What train.py, eval.py, study.py and bench.py share: data, training helpers, evaluation, the study's statistics.

Not part of a checkpoint: the model is `ddl`, and a saved folder loads without this package.
"""
