"""``python -m proxy.sim``: the simulator without the rest of the CLI."""

from __future__ import annotations

import sys

from proxy.sim.sim_command import main

sys.exit(main())
