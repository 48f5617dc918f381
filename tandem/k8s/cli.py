"""``tandem-k8s render``: the Kubernetes manifests of one config, so nobody edits YAML by hand.

    tandem-k8s render --config configs/grpo.toml --nodes 2 [--image IMG] [--kind trainjob] \\
        [--out FILE] [--section.key=value ...]

Prints (or writes) multi-document YAML: the dump folder's ReadWriteMany claim and a JobSet
(``--kind jobset``, the default) or a TrainingRuntime and a TrainJob (``--kind trainjob``).
Overrides change the config the manifests are made from and are passed on to train.py in the
pods. A bad config, node count or override is one line and exit 2 (docs/kubernetes.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

from tandem.rl.core.configlib import EXIT_CONFIG_ERROR, ConfigError

_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_./-]+$")


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if v is None:
        return "null"
    return json.dumps(str(v))  # a JSON string is a YAML double-quoted scalar: never re-typed


def to_yaml(obj: Any, indent: int = 0) -> list[str]:
    """Block-style YAML lines of nested dicts, lists and scalars (strings always quoted)."""
    pad = " " * indent
    out: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = k if _PLAIN_KEY.match(k) else json.dumps(k)
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{key}:")
                out += to_yaml(v, indent + 2)
            elif isinstance(v, (dict, list)):
                out.append(f"{pad}{key}: {'{}' if isinstance(v, dict) else '[]'}")
            else:
                out.append(f"{pad}{key}: {_scalar(v)}")
    else:
        for item in obj:
            if isinstance(item, (dict, list)) and item:
                lines = to_yaml(item, indent + 2)
                out.append(f"{pad}- {lines[0][indent + 2 :]}")
                out += lines[1:]
            else:
                out.append(
                    f"{pad}- {_scalar(item) if not isinstance(item, (dict, list)) else '{}'}"
                )
    return out


def render_documents(
    config: str,
    nodes: int,
    kind: str = "jobset",
    image: str | None = None,
    extra: Sequence[str] = (),
) -> tuple[list[dict[str, Any]], Any]:
    """The objects of ``config`` on ``nodes`` nodes, and the `Plan` they were made from."""
    from tandem.k8s.render import jobset, make_plan, trainjob
    from tandem.rl.config.schema import load_config

    if not os.path.isfile(config):
        raise ConfigError(f"--config: {config}: no such file")
    overrides = list(extra) + ([f"--k8s.image={image}"] if image else [])
    cfg = load_config(config, overrides)
    passed = tuple(o for o in extra if not o.startswith("--k8s."))  # train.py needs no [k8s]
    plan = make_plan(
        cfg, os.path.relpath(config) if not os.path.isabs(config) else config, nodes, passed
    )
    return (jobset(plan) if kind == "jobset" else trainjob(plan)), plan


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="tandem-k8s", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="print the manifests of a config")
    r.add_argument("--config", required=True, help="the TOML config (a path inside the image)")
    r.add_argument("--nodes", type=int, required=True, help="training pods (one per node)")
    r.add_argument("--image", help="the container image (else k8s.image)")
    r.add_argument("--kind", choices=("jobset", "trainjob"), default="jobset")
    r.add_argument("--out", help="write here instead of stdout")
    args, extra = ap.parse_known_args(argv)
    bad = [o for o in extra if not o.startswith("--") or "." not in o.split("=")[0]]
    if bad:
        print(
            f"error: {bad[0]!r} is neither a flag of tandem-k8s render nor --section.key=value",
            file=sys.stderr,
        )
        return EXIT_CONFIG_ERROR
    from tandem.k8s.render import header

    try:
        docs, plan = render_documents(args.config, args.nodes, args.kind, args.image, extra)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    text = header(plan, args.kind, argv) + "".join(
        "---\n" + "\n".join(to_yaml(d)) + "\n" for d in docs
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
