"""``python -m nvfp4lab``: the same as the ``nvfp4lab`` console script."""

import sys

from nvfp4lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
