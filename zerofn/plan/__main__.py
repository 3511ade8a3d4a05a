"""``python -m zerofn.plan ...``, the same as ``python -m zerofn plan ...``."""

import sys

from zerofn.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
