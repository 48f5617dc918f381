"""``python -m tandem.k8s``: the same as ``tandem-k8s`` (tandem/k8s/cli.py)."""

import sys

from tandem.k8s.cli import main

sys.exit(main())
