#!/usr/bin/env python3
"""Keeps a Redis busy with the gateway's batch work for another client (bench/speed.sh, cell 2r).

    redis_load.py PORT SCRIPT DECISIONS_PER_SECOND BATCH SECONDS

Sends EVALSHA of SCRIPT (lua/batch.lua as the gateway loads it) with BATCH token-bucket
decisions on random ones of 10 000 keys of the gateway's shape, one call in flight as the
gateway's decision connection has, paced to DECISIONS_PER_SECOND, for SECONDS. Cell 2r runs
the unlimited gateway beside it: what Redis's work next door costs a gateway that does not
limit, so that cell 3 - cell 2r is the limiter's own cost.
"""
import random
import socket
import sys
import time

BIG, FAST = 1000000000000000, 1000000000000


def command(*parts):
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        p = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def reply(sock, buf):
    """Reads one reply (a line, or a bulk string); returns it and what is left."""
    while b"\r\n" not in buf:
        buf += sock.recv(65536)
    head, rest = buf.split(b"\r\n", 1)
    if head[:1] != b"$":
        return head, rest
    size = int(head[1:])
    while len(rest) < size + 2:
        rest += sock.recv(65536)
    return rest[:size], rest[size + 2:]


def main():
    port, script, rate, batch, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    sock = socket.create_connection(("127.0.0.1", int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(command("SCRIPT", "LOAD", open(script, "rb").read()))
    sha, buf = reply(sock, b"")
    if len(sha) != 40:
        sys.exit(f"the batch script does not load: {sha!r}")
    # Made beforehand, so that the driver's own CPU stays small beside Redis's.
    calls_made = []
    for _ in range(1000):
        keys = [b"sentinel:v1:%064x:bench.load:1" % random.randrange(10000) for _ in range(batch)]
        args = [1, 1, BIG, FAST, 1000000]
        for _ in range(batch):
            args += [0, 1]  # no deadline, the batch's one limit
        calls_made.append(command("EVALSHA", sha, batch, *keys, *args))
    every = batch / rate
    start = time.monotonic()
    calls = 0
    while True:
        due = start + calls * every
        now = time.monotonic()
        if now - start >= seconds:
            break
        # Sleeps only when 2 ms ahead: fewer wake-ups of its own, the same rate.
        if due - now > 0.002:
            time.sleep(due - now)
        sock.sendall(calls_made[calls % len(calls_made)])
        answer, buf = reply(sock, buf)
        if answer.startswith(b"-"):
            sys.exit(f"redis refused the batch: {answer!r}")
        calls += 1
    print(f"calls {calls} decisions {calls * batch} cpu_seconds {time.process_time():.3f}")


if __name__ == "__main__":
    main()
