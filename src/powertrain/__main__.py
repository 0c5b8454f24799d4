import sys

from powertrain.train.cli import main

sys.exit(main())
