"""`python -m relay` is `relayfleet relay`."""

import sys

from relay.cli import main

sys.exit(main(["relay", *sys.argv[1:]]))
