"""Tandem: PyTorch-native RL post-training, rollout and update colocated in one torchrun program.

The one import root. Its folders, each with one job:

    models/    model definitions and HF I/O (nothing of parallelism or RL)
    parallel/  meshes, FSDP2 / TP / PP / EP, the reshard into the generation layout (nothing of RL)
    kernels/   Triton kernels, each beside its PyTorch reference
    rl/        recipes, generator, rollout, update, algorithms, rewards, envs, workers, data,
               fault, runtime
    train.py   the training entry point (the repository's train.py runs it)
    generate.py, diagnose.py, sweep/, report/   the tools behind tandem-generate, tandem-diagnose,
               tandem-sweep and tandem-report
"""
