"""The trainer's side of a gloo weight broadcast, run as a real second process by the tests.

``python -m tests.engine.weight_sender --port P --file W.safetensors --group G`` hosts the
TCP store as rank 0 of a 2-rank group, then broadcasts every tensor of the file in the
file's key order (the order the test names them to the engine).

``--refused DTYPE:D0xD1,...`` first plays a trainer whose earlier updates the cell refuses:
one broadcast per entry of a tensor of that dtype and shape (filled with 7s), each its own
update; the trainer broadcasts what it announced whether the cell accepts it or not.
"""

from __future__ import annotations

import argparse

import torch
from safetensors.torch import load_file

from services.engine.weights import broadcast_rank0, join_weight_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--file", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--names", required=True, help="comma-separated, in broadcast order")
    parser.add_argument("--refused", default="", help="comma-separated DTYPE:D0xD1 broadcasts sent first")
    args = parser.parse_args()
    tensors = load_file(args.file)
    group, _store = join_weight_group("127.0.0.1", args.port, 0, 2, args.group, timeout_s=60)
    for entry in filter(None, args.refused.split(",")):
        dtype, dims = entry.split(":")
        shape = [int(d) for d in dims.split("x")]
        broadcast_rank0(group, torch.full(shape, 7, dtype=getattr(torch, dtype)))
    for name in args.names.split(","):
        broadcast_rank0(group, tensors[name].contiguous())
    print("sent", len(tensors), flush=True)


if __name__ == "__main__":
    import os

    main()
    # Leave without running gloo's C++ destructors: the store this rank hosts can be torn
    # down while the engine still holds the group, which aborts the process at exit
    # ("terminate called without an active exception") after all the work is done.
    os._exit(0)
