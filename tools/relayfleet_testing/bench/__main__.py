import sys

from relayfleet_testing.bench import main

sys.exit(main(sys.argv[1:]))
