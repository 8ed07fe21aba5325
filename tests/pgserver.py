"""Start a throwaway PostgreSQL server from local binaries (for machines without one).

Used only when ``GYRE_TEST_POSTGRES_URL`` is not set. The server lives in a temp folder,
listens on a free loopback port only, and is stopped at interpreter exit.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time

_URL: list[str | None] = []


def _bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    hits = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return hits[-1] if hits else None


def throwaway_server_url() -> str | None:
    if _URL:
        return _URL[0]
    _URL.append(_start())
    return _URL[0]


def _start() -> str | None:
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if not initdb or not pg_ctl:
        return None
    from libs.common.natsserver import free_port

    run_as: list[str] = []
    data = tempfile.mkdtemp(prefix="gyre-pg-")
    if os.geteuid() == 0:  # initdb refuses root: run it as the postgres user
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            return None
        os.chown(data, pw.pw_uid, pw.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    port = free_port()
    subprocess.run([*run_as, initdb, "-D", data, "-A", "trust", "-U", "postgres"], check=True,
                   capture_output=True)
    subprocess.run([*run_as, pg_ctl, "-D", data, "-o", f"-h 127.0.0.1 -p {port} -k {data}", "-l",
                    f"{data}/log", "-w", "start"], check=True, capture_output=True)

    def _stop() -> None:
        subprocess.run([*run_as, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)

    atexit.register(_stop)
    time.sleep(0.2)
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"
