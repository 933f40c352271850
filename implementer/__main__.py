import sys

from implementer.cli import main

sys.exit(main())
