"""Wall time of `kvcache run` (analyze -> render -> validate) on the DeepSeek-V4 fixtures, both deployment modes.

Each case is one fresh ``kvcache run --config FIXTURE --dispatch 部署模式：框架部署|独立部署 --out DIR --force``
process, as a user runs it (the CLI's import cost included), with torch's default intra-op threads: the acceptance
figure is taken on 2 idle cores, so OMP_NUM_THREADS is removed from the child's environment unless --threads
is given. On a shared machine the wall time grows with the other processes' load; the child's CPU time (user +
system) is printed beside it and does not.

Fixtures: tests/fixtures/configs/deepseek_v4.json (window + CSA + HCA layers) and deepseek_v4_hca.json (window +
HCA layers), DeepseekV4Config defaults with fewer layers (tests/fixtures/configs/SOURCES.md).
Target on 2 idle cores: <= 90 s per deployment mode (issue #38).

Run: python benchmarks/bench_v4.py [--only csa|hca] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "configs"
TARGET_S = 90.0  # per deployment mode
CONFIGS = {"csa": FIXTURES / "deepseek_v4.json", "hca": FIXTURES / "deepseek_v4_hca.json"}
MODES = {"framework": "部署模式：框架部署", "standalone": "部署模式：独立部署"}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_case(config: Path, dispatch: str, threads: int | None) -> tuple[float, float, int, str]:
    """One ``kvcache run`` in a fresh process: (wall s, CPU s, exit code, its last output line)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-v4-") as tmp:
        cmd = [sys.executable, "-m", "model_infer_kvcache", "run", "--config", str(config), "--dispatch", dispatch,
               "--out", str(Path(tmp) / "out"), "--force"]
        c0, t0 = _children_cpu(), time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        dt, cpu = time.perf_counter() - t0, _children_cpu() - c0
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return dt, cpu, proc.returncode, lines[-1][:120] if lines else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=sorted(CONFIGS), action="append", help="one fixture (repeatable); default all")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the child (default: torch's own)")
    args = p.parse_args(argv)
    names = args.only or [n for n in CONFIGS if CONFIGS[n].is_file()]
    missing = [n for n in names if not CONFIGS[n].is_file()]
    if missing:
        print(f"--only: no fixture {CONFIGS[missing[0]]}", file=sys.stderr)
        return 2
    rows = []
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start "
          f"(threads: {args.threads or 'default'})", flush=True)
    for name in names:
        for mode, dispatch in MODES.items():
            dt, cpu, rc, last = run_case(CONFIGS[name], dispatch, args.threads)
            rows.append((f"deepseek_v4 {name} {mode}", dt, cpu, rc, last))
            print(f"{rows[-1][0]:32s} {dt:6.1f} s (CPU {cpu:6.1f} s)  exit {rc}"
                  f"{'' if dt <= TARGET_S else '  ABOVE TARGET'}  {last}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print()
    print("| case | wall (s) | CPU (s) | result | target (s) |")
    print("|---|---|---|---|---|")
    for name, dt, cpu, rc, _ in rows:
        print(f"| {name} | {dt:.1f} | {cpu:.1f} | {'passed' if rc == 0 else f'exit {rc}'} | {TARGET_S:.0f} |")
    return 0 if all(r[3] == 0 and r[1] <= TARGET_S for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
