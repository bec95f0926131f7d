# kazoo's Lock, measured the way zookeeper-compare measures the other sides:
#   python3 kazoo_bench.py <hosts> <path> <clients> <millis> <contended 0|1>
# prints one line: "bench <cycles> <per-client counts> <acquire ns,...> <hand-off ns,...>".
import sys
import threading
import time

from kazoo.client import KazooClient

hosts, path, clients, millis, contended = sys.argv[1:6]
clients, millis, contended = int(clients), int(millis), contended == "1"
zk = KazooClient(hosts=hosts, timeout=10.0)
zk.start()
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
        last_release[0] = time.monotonic_ns()
        lock.release()


# One warm-up cycle: the lock's parent nodes exist before the clock starts.
warm = zk.Lock(path + "-warm")
warm.acquire()
warm.release()
threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
for t in threads:
    t.start()
end[0] = time.monotonic_ns() + millis * 1_000_000
start.set()
for t in threads:
    t.join()
flat = lambda lists: ",".join(str(v) for l in lists for v in l) or "-"
print("bench %d %s %s %s" % (sum(counts), ",".join(map(str, counts)), flat(acquires), flat(handoffs)))
zk.stop()
