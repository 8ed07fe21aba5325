"""The core's side of a distributed publication, as a second process (a gloo group has
one rank per process): ``python -m tests.trainer.dist_publisher URL TOKEN FILE VERSION``."""

from __future__ import annotations

import asyncio
import sys


async def main(url: str, token: str, file: str, version: int) -> None:
    from safetensors.torch import load_file

    from services.engine.client import EngineClient
    from services.trainer.publish import EnginePublisher

    weights = load_file(file)
    async with EngineClient(url, admin_token=token) as client:
        publish = EnginePublisher({"cell-a": client}, mode="distributed")
        print("published to", await publish(version, weights), flush=True)
        await publish.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
