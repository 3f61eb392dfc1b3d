"""What runs a command, below everything else: the one-line error, a setting's declaration, the command line
(flags, --config), files written whole, and the cost line (time, peak memory). Imports nothing of the repo."""
