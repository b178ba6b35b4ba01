"""zenflow.train: the fine-tuning run around the engine.

``data`` (GLUE tasks, tokenised batches), ``models`` (model and tokenizer resolution),
``runs`` (run directories, atomic JSON), ``trainer`` (the run loop, checkpoints, resume).
"""
