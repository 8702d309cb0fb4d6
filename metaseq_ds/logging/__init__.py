"""Training metrics: `metrics` (aggregation contexts and log_* functions) and its `meters`."""
