"""zenflow: the ZenFlow training engine."""
