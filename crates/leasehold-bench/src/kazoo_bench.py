# kazoo's Lock, driven by zookeeper-compare the way it drives Curator: one line per command.
#   python3 kazoo_bench.py <hosts>
#   bench <path> <clients> <millis> <contended 0|1> [<hold micros>]
#       -> "bench <cycles> <per-client counts> <acquire ns,...> <hand-off ns,...>"
#   quit
# Every worker measures its own cycles; all share one KazooClient (one session).
import sys
import threading
import time

from kazoo.client import KazooClient

zk = KazooClient(hosts=sys.argv[1], timeout=10.0)
zk.start()


def bench(path, clients, millis, contended, hold_us):
    counts = [0] * clients
    acquires = [[] for _ in range(clients)]
    handoffs = [[] for _ in range(clients)]
    last_release = [0]
    start = threading.Event()
    end = [0]

    def run(i):
        lock = zk.Lock(path if contended else "%s-%d" % (path, i))
        start.wait()
        while time.monotonic_ns() < end[0]:
            asked = time.monotonic_ns()
            lock.acquire()
            got = time.monotonic_ns()
            acquires[i].append(got - asked)
            released = last_release[0]
            if contended and released > asked:
                handoffs[i].append(got - released)
            counts[i] += 1
            if hold_us:
                time.sleep(hold_us / 1e6)
            last_release[0] = time.monotonic_ns()
            lock.release()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    end[0] = time.monotonic_ns() + millis * 1_000_000
    start.set()
    for t in threads:
        t.join()
    flat = lambda lists: ",".join(str(v) for l in lists for v in l) or "-"
    return "bench %d %s %s %s" % (
        sum(counts), ",".join(map(str, counts)), flat(acquires), flat(handoffs))


print("ready", flush=True)
for line in sys.stdin:
    words = line.split()
    if not words or words[0] == "quit":
        break
    try:
        hold = int(words[5]) if len(words) > 5 else 0
        print(bench(words[1], int(words[2]), int(words[3]), words[4] == "1", hold), flush=True)
    except Exception as e:  # reported, not fatal
        print("error %r" % (e,), flush=True)
zk.stop()
