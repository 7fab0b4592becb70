"""Fuzz the daemon protocol: framing, schemas and every request handler, in process (no sockets).

::

    pip install atheris                                   # not needed by CI; only for this mode
    python tools/fuzz_protocol.py --random 500 --write-corpus corpus/   # a seed corpus of valid + mutated frames
    python tools/fuzz_protocol.py corpus/ -atheris_runs=200000          # coverage-guided (libFuzzer options pass through)
    python tools/fuzz_protocol.py --random 20000 --seed 3 # no atheris: seeded random + mutated frames

Each input is cut into chunks (its first byte picks the chunk size) and fed to a
:class:`~ectier.daemon.protocol.FrameDecoder`; every decoded message goes through
``ectier.daemon.handlers.handle`` of a server whose ``TieredCache`` holds a few known entries, on a fresh
connection per input (closed after it, which ends its leases). Three inputs in four start on a
connection that already said ``hello`` (so the handlers behind it run); the fourth on a bare
one, where everything before a valid ``hello`` must be refused. The oracle:

- the decoder raises nothing but a fatal ``ProtocolError``; ``parse_request`` nothing but ``ProtocolError``;
- ``handle`` never answers ``InternalError`` (an exception a handler did not expect) and every reply
  encodes as a frame; before a successful ``hello`` every request is refused (``ProtocolError``);
- after the connection is gone (and its reservations, orphans of this live process, ended as the
  process's exit would end them): no lease, reservation or pin is left; every known entry is either
  absent (a valid ``delete`` may remove it; it is put back) or byte-exact, unless the input held a
  valid ``reserve`` of its key (a commit may then overwrite it: it is put back).

A failure raises ``AssertionError`` (atheris then saves the crashing input).
"""

from __future__ import annotations

import argparse
import atexit
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from ectier import testing

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402

_STATE: dict = {}

KNOWN_OPS = ["hello", "ping", "reserve", "commit", "abort", "get", "release", "contains", "delete", "stats", "nope"]
KEYS = ["fz-a", "fz-b", "zz", "", "\x00", "é" * 3]


def _setup() -> None:
    """Build the server under test once per process."""
    import torch

    from ectier.config import CacheConfig
    from ectier.daemon.server import DaemonServer
    from ectier.tensors import byte_view

    tmp = tempfile.mkdtemp(prefix="ectier-fuzz-")
    cfg = CacheConfig.from_dict({
        "namespace": "fuzz",
        "host": {"capacity_bytes": 2 << 20, "block_bytes": 16 << 10, "pin_memory": False, "admit_wait_s": 0.05},
        "nvme": {"path": os.path.join(tmp, "nvme"), "capacity_bytes": 8 << 20, "sync": False,
                 "map_initial_bytes": 4 << 20, "write_through": True},
        "daemon": {"socket_path": os.path.join(tmp, "d.sock"), "shm_dir": tmp, "max_frame_bytes": 64 << 10},
    })
    from ectier.cache import TieredCache

    server = DaemonServer(cfg)
    server.use_cache(TieredCache(cfg))  # no socket, no shm arena: handlers are called directly
    known = {k: torch.arange(i * 1000 + 1, dtype=torch.int32) for i, k in enumerate(["fz-a", "fz-b"])}
    for k, t in known.items():
        server.cache.put(k, t)
    _STATE.update(server=server, known=known, bytes={k: bytes(byte_view(t).numpy()) for k, t in known.items()},
                  torch=torch, byte_view=byte_view, tmp=tmp)
    atexit.register(_teardown)


def _teardown() -> None:
    """Close the store and remove the temporary directory (at interpreter exit)."""
    server = _STATE.get("server")
    try:
        if server is not None and server.cache is not None:
            server.cache.close()
    finally:
        if _STATE.get("tmp"):
            shutil.rmtree(_STATE["tmp"], ignore_errors=True)


def one_input(data: bytes) -> None:
    """Run one fuzz input through decoder, schema and handlers; raise AssertionError on a finding."""
    from ectier.daemon.protocol import PROTOCOL_VERSION, FrameDecoder, ProtocolError, encode_frame
    from ectier.daemon.connections import Connection
    from ectier.daemon.handlers import handle

    if not _STATE:
        _setup()
    server = _STATE["server"]
    cache = server.cache
    a, b = socket.socketpair()
    conn = Connection(1 << 20, a, os.getpid(), os.getuid(), os.getgid())
    server._conns[conn.id] = conn
    try:
        if not data or data[0] % 4 != 3:
            hello = handle(server, conn, {"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "client": "fuzz"})
            assert hello["ok"], hello
        decoder = FrameDecoder(64 << 10)
        rewritten: set[str] = set()
        step, body = 1 + (data[0] if data else 0), data[1:]
        for i in range(0, max(len(body), 1), step):
            try:
                messages = decoder.feed(body[i:i + step])
            except ProtocolError as exc:
                assert exc.fatal, f"non-fatal ProtocolError raised by feed: {exc}"
                break
            for msg in messages:
                if isinstance(msg, dict) and msg.get("op") == "reserve" and isinstance(msg.get("key"), str) \
                        and msg["key"] in _STATE["known"]:
                    rewritten.add(msg["key"])  # a valid reserve + commit may overwrite it: put back below
                greeted = conn.greeted
                reply = handle(server, conn, msg)
                encode_frame(reply, max_frame_bytes=1 << 30)
                if not reply["ok"]:
                    assert reply["error"]["type"] != "InternalError", reply
                if not greeted and not (isinstance(msg, dict) and msg.get("op") == "hello"):
                    assert not reply["ok"] and reply["error"]["type"] == "ProtocolError", reply
    finally:
        server._disconnect(conn)
        b.close()
        # this process lives on, so its reservations became orphans (docs/protocol.md, "Leases"):
        # end them as its exit would
        for lease in list(server.leases._orphans):
            assert server.end_orphan(conn, lease), "an orphan of another process"
    host = testing.tier(cache, "host")
    assert host.index.reserved_bytes == 0, "a reservation outlived its connection"
    assert testing.pins(cache, "host") == 0, "a pin outlived its connection"
    assert not server.leases, "a lease outlived its connection"
    torch, byte_view = _STATE["torch"], _STATE["byte_view"]
    for k, t in _STATE["known"].items():
        got = cache.get(k)
        if k in rewritten:
            cache.put(k, t)
        elif got is None:
            cache.put(k, t)  # deleted by a valid request: put it back for the next input
        else:
            assert got.dtype == t.dtype and bytes(byte_view(got).numpy()) == _STATE["bytes"][k], f"{k} changed"


def _random_message(rng: random.Random) -> dict:
    op = rng.choice(KNOWN_OPS)
    msg: dict = {"id": rng.choice([rng.randrange(1 << 31), -1, "x", None, True, 2**64 - 1]), "op": op}
    for name in rng.sample(["key", "namespace", "dtype", "shape", "lease", "version", "client", "extra"],
                           rng.randrange(0, 5)):
        msg[name] = rng.choice([
            rng.choice(KEYS), rng.randrange(-5, 1 << 40), rng.choice(["uint8", "bfloat16", "float128", ""]),
            [rng.randrange(-2, 70) for _ in range(rng.randrange(0, 4))], None, True, 1.5, b"\x00" * 3,
            {"a": 1}, [1.5], 1, 0,
        ])
    return msg


def _valid_message(rng: random.Random) -> dict:
    """A message that passes its schema (so the handlers run), with lease ids near the server's."""
    op = rng.choice(KNOWN_OPS[:-1])
    msg: dict = {"id": rng.randrange(1 << 31), "op": op}
    if op == "hello":
        msg.update(version=rng.choice([1, 1, 1, 2]), client=rng.choice(KEYS))
    elif op in ("get", "contains", "delete"):
        msg["key"] = rng.choice(KEYS)
        if rng.random() < 0.2:
            msg["namespace"] = rng.choice(["fuzz", "other", ""])
    elif op == "reserve":
        msg.update(key=rng.choice(KEYS), dtype=rng.choice(["uint8", "bfloat16", "float32", "bool", "float8_e4m3fn"]),
                   shape=[rng.randrange(0, 300) for _ in range(rng.randrange(0, 4))])
        if rng.random() < 0.1:
            msg["shape"] = [1 << 40, 1 << 40]
    elif op in ("commit", "abort", "release"):
        next_id = _STATE["server"]._next_id if _STATE else 1
        msg["lease"] = max(0, next_id - rng.choice([1, 1, 1, 2, 3, 0, -1, 5]))
    return msg


def random_input(rng: random.Random) -> bytes:
    if not _STATE:
        _setup()
    kind = rng.random()
    if kind < 0.15:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
    frames = b""
    for _ in range(rng.randrange(1, 6)):
        msg = _valid_message(rng) if kind < 0.75 else _random_message(rng)
        body = msgpack.packb(msg, use_bin_type=True)
        frames += len(body).to_bytes(4, "big") + body
    if kind > 0.6:
        b = bytearray(frames)
        for _ in range(rng.randrange(1, 4)):
            p = rng.randrange(len(b))
            b[p] = rng.randrange(256)
        frames = bytes(b)
    return bytes([rng.randrange(256)]) + frames


def run_random(iterations: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(iterations):
        one_input(random_input(rng))


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM/SIGHUP: exit through SystemExit so that the atexit clean-up removes the store."""
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    p = argparse.ArgumentParser(prog="fuzz_protocol", description=__doc__.split("\n\n")[0])
    p.add_argument("--random", type=int, default=None, metavar="N", help="N seeded random inputs, no atheris")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--write-corpus", type=Path, default=None, metavar="DIR",
                   help="with --random N: write the N inputs to DIR (a seed corpus for atheris) instead of running them")
    known, rest = p.parse_known_args(argv)
    if known.random is not None:
        if known.random < 1:
            p.error("--random: expected a positive number of inputs")
        if known.write_corpus is not None:
            known.write_corpus.mkdir(parents=True, exist_ok=True)
            rng = random.Random(known.seed)
            for i in range(known.random):
                (known.write_corpus / f"seed-{i:06d}").write_bytes(random_input(rng))
            print(f"{known.random} inputs written to {known.write_corpus}")
            return 0
        run_random(known.random, known.seed)
        print(f"{known.random} inputs, no finding")
        return 0
    try:
        import atheris
    except ImportError:
        print("atheris is not installed: `pip install atheris`, or run without it: --random N", file=sys.stderr)
        return 2
    import torch  # noqa: F401 - imported before instrumenting: coverage of torch is noise (and slow)

    import ectier.cache  # noqa: F401

    with atheris.instrument_imports(include=["ectier"]):
        import ectier.daemon.protocol  # noqa: F401
        import ectier.daemon.server  # noqa: F401
    atheris.Setup([sys.argv[0], *rest], one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
