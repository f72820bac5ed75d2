import sys

from mlxfun.cli.main import main

sys.exit(main())
