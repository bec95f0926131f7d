// A small Apache Curator client driven over stdin/stdout, for leasehold's interop tests and
// benchmarks: one line per command, one line per answer.
//
//   java CuratorDriver <connect string> <session timeout ms>
//
//   lock <path>                 -> "locked <path>"          (InterProcessMutex.acquire)
//   trylock <path> <millis>     -> "locked <path>" | "busy"
//   unlock <path>               -> "unlocked <path>"
//   bench <path> <clients> <millis> <contended 0|1> [<hold micros>]
//                               -> "bench <cycles> <per-client counts,...> <acquire ns,...> <hand-off ns,...>"
//   quit
//
// Every answer that is not one of these starts with "error ".

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.AtomicLongArray;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;

public class CuratorDriver {
    public static void main(String[] args) throws Exception {
        String connect = args[0];
        int sessionMs = Integer.parseInt(args[1]);
        CuratorFramework client = CuratorFrameworkFactory.builder()
            .connectString(connect)
            .sessionTimeoutMs(sessionMs)
            .connectionTimeoutMs(Math.min(sessionMs, 15000))
            .retryPolicy(new RetryNTimes(100, 50))
            .build();
        client.start();
        client.blockUntilConnected();
        PrintStream out = new PrintStream(System.out, true);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        Map<String, InterProcessMutex> held = new HashMap<>();
        out.println("ready");
        String line;
        while ((line = in.readLine()) != null) {
            String[] w = line.trim().split(" ");
            try {
                switch (w[0]) {
                    case "lock": {
                        InterProcessMutex m = new InterProcessMutex(client, w[1]);
                        m.acquire();
                        held.put(w[1], m);
                        out.println("locked " + w[1]);
                        break;
                    }
                    case "trylock": {
                        InterProcessMutex m = new InterProcessMutex(client, w[1]);
                        if (m.acquire(Long.parseLong(w[2]), TimeUnit.MILLISECONDS)) {
                            held.put(w[1], m);
                            out.println("locked " + w[1]);
                        } else {
                            out.println("busy");
                        }
                        break;
                    }
                    case "unlock": {
                        held.remove(w[1]).release();
                        out.println("unlocked " + w[1]);
                        break;
                    }
                    case "bench":
                        out.println(bench(client, w[1], Integer.parseInt(w[2]),
                            Long.parseLong(w[3]), w[4].equals("1"),
                            w.length > 5 ? Long.parseLong(w[5]) : 0));
                        break;
                    case "quit":
                        client.close();
                        return;
                    default:
                        out.println("error unknown command " + w[0]);
                }
            } catch (Exception e) {
                out.println("error " + e.toString().replace('\n', ' '));
            }
        }
        client.close();
    }

    /**
     * Acquire+release cycles for `millis` by `clients` threads, on one path if contended,
     * each lock held for `holdMicros`.
     */
    static String bench(CuratorFramework client, String path, int clients, long millis,
                        boolean contended, long holdMicros) throws Exception {
        AtomicLongArray counts = new AtomicLongArray(clients);
        List<List<Long>> acquires = new ArrayList<>();
        List<List<Long>> handoffs = new ArrayList<>();
        AtomicLong lastRelease = new AtomicLong(0);
        CountDownLatch start = new CountDownLatch(1);
        long[] end = new long[1];
        Thread[] threads = new Thread[clients];
        for (int i = 0; i < clients; i++) {
            final int id = i;
            final List<Long> acq = new ArrayList<>();
            final List<Long> hand = new ArrayList<>();
            acquires.add(acq);
            handoffs.add(hand);
            final InterProcessMutex m =
                new InterProcessMutex(client, contended ? path : path + "-" + id);
            threads[i] = new Thread(() -> {
                try {
                    start.await();
                    while (System.nanoTime() < end[0]) {
                        long asked = System.nanoTime();
                        m.acquire();
                        long got = System.nanoTime();
                        acq.add(got - asked);
                        long released = lastRelease.get();
                        if (contended && released > asked) {
                            hand.add(got - released);
                        }
                        counts.incrementAndGet(id);
                        if (holdMicros > 0) {
                            java.util.concurrent.locks.LockSupport.parkNanos(holdMicros * 1000);
                        }
                        lastRelease.set(System.nanoTime());
                        m.release();
                    }
                } catch (Exception e) {
                    throw new RuntimeException(e);
                }
            });
            threads[i].start();
        }
        end[0] = System.nanoTime() + millis * 1_000_000L;
        start.countDown();
        for (Thread t : threads) {
            t.join();
        }
        StringBuilder sb = new StringBuilder("bench ");
        long total = 0;
        StringBuilder per = new StringBuilder();
        for (int i = 0; i < clients; i++) {
            total += counts.get(i);
            per.append(i == 0 ? "" : ",").append(counts.get(i));
        }
        sb.append(total).append(' ').append(per).append(' ');
        sb.append(join(acquires)).append(' ').append(join(handoffs));
        return sb.toString();
    }

    static String join(List<List<Long>> lists) {
        StringBuilder sb = new StringBuilder();
        for (List<Long> l : lists) {
            for (Long v : l) {
                if (sb.length() > 0) {
                    sb.append(',');
                }
                sb.append(v);
            }
        }
        return sb.length() == 0 ? "-" : sb.toString();
    }
}
