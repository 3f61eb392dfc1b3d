"""What train.py's and eval.py's stages run on, none of it the method: every setting (`STAGES`), the checks,
checkpoints and resume, model cards and adapters, and the stages' bookkeeping (collections, logs)."""
