"""``python -m proxy`` is ``headroom``."""

from __future__ import annotations

import sys

from proxy.process.cli import main

sys.exit(main())
