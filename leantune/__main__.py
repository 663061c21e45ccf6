"""`python -m leantune <verb> ...`: what torchrun and accelerate launch run on every process."""

import sys

from leantune.cli import main

if __name__ == "__main__":
    sys.exit(main())
