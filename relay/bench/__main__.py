import sys

from relay.bench import main

sys.exit(main(sys.argv[1:]))
