import sys

from relayfleet_operator.main import main

sys.exit(main())
