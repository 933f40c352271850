import sys

from model_infer_kvcache.validators.probe.cli import main

sys.exit(main())
