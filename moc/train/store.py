"""`python -m moc.train.store --port P`: the job's store on a machine that does not train.

In-job recovery keeps the job's generations, members and leases in a store, and the
store must outlive any training machine (a lost machine must not take it along). On a
cluster, run this on the login or scheduler node and point torchrun's c10d rendezvous at
it (`--rdzv-endpoint HOST:P --rdzv-conf is_host=false`) and moc at it
(`MOC_JOB_STORE=HOST:P`) on every node; `moc train --nodes` does the same in its
launcher (`moc.train.nodes.serve_store`). It serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moc.train.store",
                                     description="serve the job's store (in-job recovery)")
    parser.add_argument("--port", type=int, required=True, help="TCP port to serve on")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default all)")
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from moc.topology import COLLECTIVE_TIMEOUT

    store = dist.TCPStore(args.host, args.port, is_master=True, wait_for_workers=False,
                          timeout=COLLECTIVE_TIMEOUT)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    print(f"moc: the job's store serves on {args.host}:{args.port}", file=sys.stderr,
          flush=True)
    stop.wait()
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
