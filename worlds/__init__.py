"""The environments other than ALFWorld (envs.py), each behind envs.py's interface and loaded by
name from its registry (`envs.ENVIRONMENTS`): TextWorld's generated games, tau2-bench."""
