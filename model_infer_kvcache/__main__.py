"""``python -m model_infer_kvcache``: the ``kvcache`` command."""

import sys

from model_infer_kvcache.cli import main

sys.exit(main())
