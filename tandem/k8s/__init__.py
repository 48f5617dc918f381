"""Kubernetes manifests for a config: ``tandem-k8s render`` (cli.py, render.py)."""
