"""What train.py's and eval.py's stages run on, not the method: every setting (`STAGES`), checks,
checkpoints and resume, the stages' bookkeeping (collections, logs)."""
