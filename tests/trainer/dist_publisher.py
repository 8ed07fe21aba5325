"""The core's side of a distributed publication, as a second process (a gloo group has
one rank per process): ``python -m tests.trainer.dist_publisher URL TOKEN FILE VERSION [DEAD_URL]``;
a DEAD_URL is a second cell that does not answer (it must be left out, not block the group)."""

from __future__ import annotations

import asyncio
import sys


async def main(url: str, token: str, file: str, version: int, dead: str | None) -> None:
    from safetensors.torch import load_file

    from services.engine.client import EngineClient
    from services.trainer.publish import EnginePublisher

    weights = load_file(file)
    clients = {"cell-a": EngineClient(url, admin_token=token)}
    if dead:
        clients["cell-dead"] = EngineClient(dead, admin_token=token)
    publish = EnginePublisher(clients, mode="distributed")
    print("published to", await publish(version, weights), flush=True)
    await publish.close()
    for client in clients.values():
        await client.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), (sys.argv[5:] or [None])[0]))
