import sys

from validators.probe.cli import main

sys.exit(main())
