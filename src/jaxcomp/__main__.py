"""``python -m jaxcomp``: the command line (:mod:`jaxcomp.cli`)."""

import sys

from jaxcomp.cli import main

if __name__ == "__main__":
    sys.exit(main())
