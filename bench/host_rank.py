"""One rank of bench.common.run_on_hosts, as the launcher starts it on an emulated host: ``host_rank.py OUT``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import host_rank  # noqa: E402

if __name__ == "__main__":
    host_rank(sys.argv[1])
