"""The config schema: every section a recipe reads, checked against the registries.

schema.py      the root config (job, model, data, optimizer, training, parallel, ...),
               load_config and parse_args (train.py's command line)
rl_schema.py   the sections of the rl recipe (rl, rollout, reward, critic, distill, env)
"""
