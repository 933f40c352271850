"""Wall time of a standalone-runner validation, as the CLI runs it, in one run.

`kvcache validate --runner-root CHECKOUT/models/pangu_7b`: discovery, the folder's settings hooks, its runner's
init_model and two model_generate calls (warm-up, run) on the tiny model, the three links on the runner's tensors
and the recompute oracle (every prefix through a fresh prefill). Target: <= 60 s on 2 idle cores.

With --migrated: the same folder after examples/pangu_7b_standalone's patch (the standalone render in the runner:
six requests over three cache rows, early finishes and late admissions, each judged request by request).

Run: python benchmarks/bench_runner_root.py [--folder PATH] [--migrated]
(PATH defaults to $KVCACHE_SHARED/upstream/cann-recipes-infer/models/pangu_7b, else ../shared/...)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
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
    p.add_argument("--migrated", action="store_true",
                   help="time the folder after examples/pangu_7b_standalone's patch (applied to a temporary copy)")
    args = p.parse_args()
    folder = Path(args.folder)
    with tempfile.TemporaryDirectory(prefix="bench-runner-") as tmp:
        if args.migrated:
            checkout = Path(tmp) / "checkout"
            shutil.copytree(folder.parent.parent, checkout)
            patch = ROOT / "examples" / "pangu_7b_standalone" / "pangu_7b_standalone.patch"
            subprocess.run(["git", "apply", str(patch)], cwd=checkout, check=True)
            folder = checkout / "models" / folder.name
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "model_infer_kvcache", "validate", "--runner-root", str(folder)],
                              capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - started
    verdict = "passed" if done.returncode == 0 else f"exit {done.returncode}"
    label = f"{folder.name}{' (migrated)' if args.migrated else ''}"
    print(f"{label}: {verdict} in {wall:.1f} s (target <= {TARGET_S:g} s)")
    return 0 if done.returncode == 0 and wall <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
