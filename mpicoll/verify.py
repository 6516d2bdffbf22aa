"""``python -m mpicoll.verify``: the command-line tool in mpicoll/tools/verify/ (cli.py)."""

import sys

from .tools.verify import main

if __name__ == "__main__":
    sys.exit(main())
