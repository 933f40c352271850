import sys

from model_infer_kvcache.implementer.cli import main

sys.exit(main())
