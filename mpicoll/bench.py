"""``python -m mpicoll.bench``: the command-line tool in mpicoll/tools/bench.py."""

import sys

from .tools.bench import main

if __name__ == "__main__":
    sys.exit(main())
