"""``python -m mpicoll.tune``: the command-line tool in mpicoll/tools/tune/ (its cli module)."""

import sys

from .tools.tune import main

if __name__ == "__main__":
    sys.exit(main())
