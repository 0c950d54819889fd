"""Run every benchmark: `python benchmarks/run.py [--quick]` (replicas and lease_cost need PostgreSQL on 127.0.0.1)."""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import busy_loop_cancel
import bytecodes
import cancel_latency
import checkpoint_cost
import hot_path
import lease_cost
import mass_cancel
import replicas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    quick = parser.parse_args().quick
    print(f"python {platform.python_version()} on {platform.machine()}, {platform.processor() or 'cpu'}")
    for benchmark in (
        hot_path,
        bytecodes,
        cancel_latency,
        busy_loop_cancel,
        checkpoint_cost,
        mass_cancel,
        replicas,
        lease_cost,
    ):
        benchmark.main(quick)


if __name__ == "__main__":
    main()
