"""`python -m readout RUN`: a run's paired differences and its verdict in words."""
from harness.cli import run_cli
from readout.verdict import main

run_cli(main)
