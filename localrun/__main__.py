from __future__ import annotations

import sys

from localrun.cli import main

sys.exit(main())
