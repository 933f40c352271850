"""Wall time of a standalone-runner validation, as the CLI runs it, in one run.

`kvcache validate --runner-root CHECKOUT/models/pangu_7b`: discovery, the folder's settings hooks, its runner's
init_model and two model_generate calls (warm-up, run) on the tiny model, the three links on the runner's tensors
and the recompute oracle (every prefix through a fresh prefill). Target: <= 60 s on 2 idle cores.

Run: python benchmarks/bench_runner_root.py [--folder PATH]
(PATH defaults to $KVCACHE_SHARED/upstream/cann-recipes-infer/models/pangu_7b, else ../shared/...)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 60.0


def default_folder() -> Path:
    shared = Path(os.environ.get("KVCACHE_SHARED") or ROOT.parent / "shared")
    return shared / "upstream" / "cann-recipes-infer" / "models" / "pangu_7b"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folder", default=str(default_folder()), help="a standalone model folder (runner_*.py)")
    args = p.parse_args()
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", "--runner-root", args.folder],
                          capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    verdict = "passed" if done.returncode == 0 else f"exit {done.returncode}"
    print(f"{Path(args.folder).name}: {verdict} in {wall:.1f} s (target <= {TARGET_S:g} s)")
    return 0 if done.returncode == 0 and wall <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
