#!/usr/bin/env python3
"""A delay line for a link between network namespaces where the kernel has no `netem`:

    delay_line.py DEVICE DELAY_SECONDS

creates the TUN device DEVICE (in the calling process's namespace) and writes every packet
it reads back into it DELAY_SECONDS later, in order. A router namespace sends what it
forwards into the device (policy routing by incoming interface) and routes what comes back
out of it by destination, so every packet between the hosts is held DELAY_SECONDS one way,
as `tc qdisc add ... netem delay` on each end would. Run it with a real-time priority
(`chrt -f 50`): the benchmark's ranks keep every core busy, and a normal thread would wake
late. Stops on SIGTERM. Used by bench/multihost.py --delay.
"""
import collections
import fcntl
import os
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def main():
    name, delay = sys.argv[1], float(sys.argv[2])
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    os.set_blocking(fd, False)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    held = collections.deque()
    print(f"delay line {name}: {delay * 1e3:.3f} ms", flush=True)
    while True:
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready, _, _ = select.select([fd], [], [], timeout)
        if ready:
            now = time.monotonic()
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                held.append((now + delay, packet))
        now = time.monotonic()
        while held and held[0][0] <= now:
            os.write(fd, held.popleft()[1])


if __name__ == "__main__":
    main()
