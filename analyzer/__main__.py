import sys

from model_infer_kvcache.analyzer.cli import main

sys.exit(main())
