"""``python -m proxy.probe ...``: the same as ``headroom probe ...``."""

from __future__ import annotations

import sys

from proxy.probe.probe_command import main

if __name__ == "__main__":
    sys.exit(main())
