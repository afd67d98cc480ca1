"""The image's HEALTHCHECK: exit 0 when ``GET /health`` answers 200 on this container's PORT.

The runtime image has no curl; the standard library is enough. The same command runs in the
tests against a real stage 5 (``tests/test_deploy_files.py``).

    python -m deploy.docker.healthcheck   # HOST/PORT from the environment, as the server reads them
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    host = os.environ.get("HOST", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host  # bound everywhere: ask over loopback
    url = f"http://{host}:{os.environ.get('PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
