"""dflash-train entry point (not implemented yet: see issue 4)."""

import sys


def main() -> None:
    sys.exit("dflash-train is not implemented yet (tracked in issue 4); "
             "see README.md for what works today")
