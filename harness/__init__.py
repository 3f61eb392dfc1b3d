"""What runs a command (the one-line error is envs.py's): a setting's declaration, the command line
(flags, --config), files written whole."""
