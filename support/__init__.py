"""Support, below the method's five files: the engine (fast sampling, log-probs), the game pool, the command
line, checkpoints and cards, statistics, the cost line. It never imports the five; skip it on a first read."""
