"""``python -m mpicoll.tools.verify`` (the same as ``python -m mpicoll.verify``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
