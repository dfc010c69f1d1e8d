import sys

from relayfleet_testing.devfleet.cli import dev_main

sys.exit(dev_main(sys.argv[1:]))
