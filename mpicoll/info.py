"""``python -m mpicoll.info``: the command-line tool in mpicoll/tools/info.py."""

import sys

from .tools.info import main

if __name__ == "__main__":
    sys.exit(main())
