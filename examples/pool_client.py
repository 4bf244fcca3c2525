"""Publish and read KV blocks with the Python client library, against a running cluster.

    kvpool master --port 50051 &                      # prints KVPOOL_READY {...}
    kvpool store --master 127.0.0.1:50051 &           # one or more
    python examples/pool_client.py --master 127.0.0.1:50051

What it does (the calls a serving engine's connector makes, in kvpool.connector):
1. registers the namespace of (model, weights version, KV layout): blocks of another version or layout
   never match;
2. hashes a token sequence into chained 128-bit block hashes (one per full block of the layout's tokens);
3. `put_blocks`: the master reserves slots on the stores, the bytes go to the stores over UCX (never
   through the master), then the master commits them into its radix index;
4. `exists` (a peek) and `get_blocks` (a leased match, then reads from the stores; every block's xxh3
   verified) of a longer prompt with the same prefix: the shared blocks hit, the new one misses.
The block bytes here are random stand-ins for a model's KV (see kvpool.model for real ones).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from kvpool.client import MasterClient, PoolClient
from kvpool.errors import KVPoolError
from kvpool.hashing import hash_blocks
from kvpool.types import DEFAULT_LAYOUT, KVLayout
from transfer import UcxTransport


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", required=True, help="the master's HOST:PORT")
    ap.add_argument("--model", default="example-model")
    ap.add_argument("--version", default="v1", help="weights version")
    ap.add_argument("--layout", default=DEFAULT_LAYOUT, help="KV layout fingerprint (the stores' --layout)")
    args = ap.parse_args()

    layout = KVLayout.from_fingerprint(args.layout)
    block_size, block_nbytes = layout.block_size, layout.block_nbytes
    with MasterClient(args.master) as master:
        namespace, active = master.register_namespace(args.model, args.version, args.layout)
    print(f"namespace {namespace.hex()} (active version {active}), blocks of {block_nbytes} B")

    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 32_000, 4 * block_size).tolist()  # 4 full blocks
    hashes = hash_blocks(namespace, prompt, block_size)
    kv = [rng.integers(0, 256, block_nbytes, dtype=np.uint8) for _ in hashes]

    transport = UcxTransport()
    try:
        with PoolClient(args.master, transport, block_nbytes=block_nbytes) as pool:
            put = pool.put_blocks(namespace, None, hashes, kv)
            print(
                f"put: {put.num_committed} committed, {put.num_existing} already there, {put.num_failed} failed"
            )

            longer = prompt + rng.integers(0, 32_000, block_size).tolist()  # same prefix + 1 block
            longer_hashes = hash_blocks(namespace, longer, block_size)
            print(f"exists: {pool.exists(namespace, longer_hashes)} of {len(longer_hashes)} blocks cached")
            got = pool.get_blocks(namespace, longer_hashes)
            same = all(g.data == k.tobytes() for g, k in zip(got.blocks, kv, strict=False))
            print(f"get: {got.num_ok} blocks read, bytes equal to what was put: {same}")
            return 0 if put.num_failed == 0 and got.num_ok == len(hashes) and same else 1
    finally:
        transport.close()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KVPoolError as exc:  # the master unreachable, a refused call: one line, not a traceback
        sys.exit(f"pool_client: {type(exc).__name__}: {exc}")
