import sys

from mlxfun.cli import main

sys.exit(main())
