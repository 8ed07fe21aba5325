"""Test doubles for the edges a CPU machine lacks.

Fakes exactly one thing: the ``sglang.launch_server`` program (SGLang needs a GPU here).
Run as ``python -m tests.engine._fakes <SGLang flags>``, it accepts the flags that
:func:`services.engine.sglang_server.build_command` emits, writes the argv it got to
``$GYRE_FAKE_SGLANG_ARGV`` (when set) so a test can check the command line, and serves
Gyre's embedded engine (which speaks SGLang's API) on ``--host``/``--port`` with uvicorn.
Everything behind the HTTP API is real: model, tokenizer, engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from services.engine.main import serve


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="fake-sglang")
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--admin-api-key")
    parser.add_argument("--api-key")
    parser.add_argument("--weight-version")
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--context-length", type=int)
    args, _ignored = parser.parse_known_args(argv)  # GPU-only flags (--tp-size, --dtype, ...)
    record = os.environ.get("GYRE_FAKE_SGLANG_ARGV")
    if record:
        with open(record, "w") as f:
            json.dump(argv, f)
    overrides = {"admin_token": args.admin_api_key or args.api_key, "weight_version": args.weight_version,
                 "max_running_requests": args.max_running_requests, "max_context": args.context_length}
    serve(args.host, args.port, args.model_path, **overrides)


if __name__ == "__main__":
    main(sys.argv[1:])
