"""What runs a command, importing nothing of the repo: the one-line error, a setting's declaration,
the command line (flags, --config), files written whole, the cost line (time, peak memory)."""
