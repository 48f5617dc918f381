"""The ground floor of rl/: what every other folder may use, importing nothing above it.

registry.py    Registry: names -> entries with declared capabilities
errors.py      exit statuses and the errors that map to them
configlib.py   typed config sections: TOML, overrides, checks, ConfigError
system.py      host set-up (allocator, threads)
fields.py      the field a *_field setting names in a data row (dotted paths)
metrics.py     metrics.jsonl / tensorboard rows
health.py      per-rank phase times and collective waits; the straggler summary
samples.py     the per-step sample log (samples.jsonl)
optim.py       AdamW and the learning-rate schedule
modeling.py    the one model builder (meta device -> parallelize -> broadcast)
checkpoint.py  DCP checkpoints: atomic commit, checksums, resharding resume
"""
