from harness.cli import run_cli
from readout.verdict import main

run_cli(main)
