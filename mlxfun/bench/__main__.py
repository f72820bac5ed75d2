"""`python -m mlxfun.bench`: the same as `mlxfun bench`."""

import sys

from mlxfun.bench.main import main

sys.exit(main())
