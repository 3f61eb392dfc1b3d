"""What a run concludes for its reader: the statistics (intervals, paired tests) and the default
run's verdict (lab/reports.py tabulates them over runs)."""
