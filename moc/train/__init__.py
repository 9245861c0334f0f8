"""Reference trainer: config, data, loop, metrics, fault injection."""
