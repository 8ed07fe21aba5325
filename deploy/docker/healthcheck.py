#!/usr/bin/env python3
"""gyre-healthcheck [PORT [HOST]]: exit 0 when the service's /health answers 200.

Used by the image's HEALTHCHECK and by docker-compose (default port 8080, host 127.0.0.1).
A service answers 503 while it is starting or stopping, so those count as unhealthy.
Standard library only: it runs in any image that has Python.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    port = int(argv[1]) if len(argv) > 1 else 8080
    host = argv[2] if len(argv) > 2 else "127.0.0.1"
    url = f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            body = response.read(2000).decode("utf-8", "replace")
            print(body)
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: HTTP {exc.code}", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
