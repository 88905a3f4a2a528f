"""dflash-eval entry point (not implemented yet: see issue 6)."""

import sys


def main() -> None:
    sys.exit("dflash-eval is not implemented yet (tracked in issue 6); "
             "see README.md for what works today")
