"""`python -m mlxkv.cli`."""

import sys

from mlxkv.cli import main

sys.exit(main())
