"""What a run concludes, read from its folder (`python -m readout RUN`): the statistics (intervals,
paired tests) and the default run's verdict; the core never imports it."""
