"""Tandem's entry point (the code is tandem/train.py):

python train.py --config configs/quickstart.toml [--section.key=value ...]
python train.py --config configs/grpo.toml --plan [--plan.nodes=N --plan.devices_per_node=G]
torchrun --nproc-per-node 8 train.py --config configs/grpo.toml
"""

from tandem.train import cli

if __name__ == "__main__":
    cli()
