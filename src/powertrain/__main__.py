import sys

from powertrain._entry import main

sys.exit(main())
