"""``python -m rlstream ...`` (and ``torchrun ... -m rlstream learner ...``): the CLI."""

import sys

from rlstream.cli import main

if __name__ == "__main__":
    sys.exit(main())
