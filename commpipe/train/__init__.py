"""Training: configuration, the step loop, metrics and the `commpipe train` verb."""
