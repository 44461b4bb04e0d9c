"""What train.py, eval.py, study.py, bench.py and train_classifier.py share, one module per concern:

- `presets`: model shapes, the paper's recipe, run defaults, building a `DDLConfig`, parsing the command line;
- `data`: the embedded corpus, datasets from the Hub or files, the tokenizer, packing text into blocks;
- `loading`: the checkpoints a script is given, checked before they load; DDL's own parameters told by class;
- `runs`: the run's output folder and which of its checkpoints are complete; `outputs`: the folder rule every
  script shares (one writer, nothing of anyone's overwritten, unfinished writes cleared);
- `resume`: a run's record and the comparison that a resume continues it; `streaming`: a streamed dataset's position;
- `training`: `DDLTrainingArguments` (each flag checked as it is parsed) and `DDLTrainer`; `card`: the model card and
  loss curve; `hub`: publishing; `lora`: PEFT fine-tuning;
  `launch`: distributed launches; `evaluation`, `tasks`, `study`: eval.py's, train_classifier.py's and study.py's.

Not part of a checkpoint: the model is `ddl`, and a saved folder loads without this package.
"""
