"""Container health check: exit 0 when GET /health answers 200 (the engine is warmed up), else 1.

Python's standard library, because the slim images have no curl. Used by the images' HEALTHCHECK
and by the multi-host Job's readiness probe, where only process 0 serves HTTP: a follower
($JAX_PROCESS_ID > 0) reports healthy, since its failure ends the leader (which then exits 1).
Usage: python healthcheck.py [PATH]   (port: $ORCA_JAX_PORT, default 8000)
"""

import os
import sys
import urllib.request


def main() -> int:
    if int(os.environ.get("JAX_PROCESS_ID") or 0) > 0:
        return 0
    path = sys.argv[1] if len(sys.argv) > 1 else "/health"
    url = f"http://127.0.0.1:{os.environ.get('ORCA_JAX_PORT', '8000')}{path}"
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError:  # refused, timed out, or an HTTP error status such as 503 while warming up
        return 1


if __name__ == "__main__":
    sys.exit(main())
