#!/usr/bin/env python3
"""Where the time of a replayed graph goes, from kernel_trace.cpp's records.

    report.py TRACE [TRACE_B] [--graph most|ID] [--nodes] [--link-gaps]
    report.py TRACE --eager

The graph is the one replayed most often (the decode step), unless --graph names one. For each
replay (its kernels share the graph launch's correlation id) the kernels are ordered by their end,
and each kernel is charged the time from the previous kernel's end to its own: in a chain of
dependent launches that is what the kernel adds to the step, whatever it overlapped. The report
prints, per kernel name, launches per step, the median duration (first block's start to last
block's end) and the median time charged per step; with a second trace, both side by side and
the difference (B - A). --nodes prints every node of the median-length replay in order.
--link-gaps (an expert cache's trace) splits the time the host link idles within each replay
(between the expert copies, those of at least 1 MiB) into the kernels that ended during each gap
of 20 us or more, charged as above, and the rest (from the last such kernel's end to the next
copy's start: the request's trip to the host's proxy and the copy's start).
--eager sums the kernels launched outside graphs (prompt chunks) by name instead.
Standard library only: it runs on the development machine and on the GPU machine alike.
"""
import argparse
import bisect
import collections
import re
import statistics
import sys


def short_name(name):
    """The kernel's own name: for an Itanium-mangled name (CUPTI gives them so) the last component
    of the nested name and its integer template arguments (gemv_stream_kernel<0,2,1,8,8>), else the
    name without namespace, template arguments and parameters."""
    if name.startswith("_ZN"):
        i, last = 3, "?"
        while i < len(name):
            m = re.match(r"\d+", name[i:])
            if m:
                n = int(m.group(0))
                i += len(m.group(0))
                last = name[i:i + n]
                i += n
            elif name[i] in "IE":
                break
            else:
                i += 1
        args = re.findall(r"L[a-z](\d+)E", name[i:]) if i < len(name) and name[i] == "I" else []
        return last + (f"<{','.join(args)}>" if args else "")
    name = re.sub(r"\(.*$", "", name)
    depth, out = 0, []
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).split("::")[-1].strip()
    if name.startswith("void "):
        name = name[5:]
    return name or "?"


def read_trace(path):
    kernels, copies = [], []
    with open(path) as f:
        for line in f:
            parts = line.split(" ", 10)
            if parts[0] == "K" and len(parts) >= 11:
                kernels.append({
                    "start": int(parts[1]), "end": int(parts[2]), "graph": int(parts[3]),
                    "corr": int(parts[5]), "grid": (int(parts[7]), int(parts[8])),
                    "name": short_name(parts[10].strip()),
                })
            elif parts[0] == "C":
                copies.append({"start": int(parts[1]), "end": int(parts[2]), "bytes": int(parts[3]),
                               "kind": int(parts[5])})
    return kernels, copies


def replays_of(kernels, graph):
    by_launch = collections.defaultdict(list)
    for k in kernels:
        if k["graph"] != 0:
            by_launch[(k["graph"], k["corr"])].append(k)
    if graph == "most":
        count = collections.Counter(g for g, _ in by_launch)
        if not count:
            sys.exit("report: no kernels launched from a graph in this trace")
        graph = count.most_common(1)[0][0]
    graph = int(graph)
    replays = [sorted(ks, key=lambda k: k["end"]) for (g, _), ks in by_launch.items() if g == graph]
    # A replay is complete when it has as many kernels as the fullest one.
    most = max(len(r) for r in replays)
    return graph, [r for r in replays if len(r) == most]


def step_start(replay):
    return min(k["start"] for k in replay)


def profile(replays):
    """Per kernel name: launches per step, median duration, median time charged per step."""
    charged = collections.defaultdict(list)
    durations = collections.defaultdict(list)
    count = collections.Counter()
    spans = []
    for r in replays:
        t0 = step_start(r)
        spans.append(r[-1]["end"] - t0)
        prev_end = t0
        per_name = collections.Counter()
        for k in r:
            per_name[k["name"]] += k["end"] - prev_end
            prev_end = k["end"]
            durations[k["name"]].append(k["end"] - k["start"])
        for name, ns in per_name.items():
            charged[name].append(ns)
    first = replays[0]
    for k in first:
        count[k["name"]] += 1
    rows = {}
    for name in count:
        rows[name] = (count[name], statistics.median(durations[name]) / 1e3,
                      statistics.median(charged[name]) / 1e3)
    return statistics.median(spans) / 1e3, rows


def print_nodes(replays):
    spans = sorted(replays, key=lambda r: r[-1]["end"] - step_start(r))
    r = spans[len(spans) // 2]
    t0 = step_start(r)
    prev_end = t0
    print("| # | kernel | grid | start us | end us | duration us | charged us |")
    print("|---|---|---|---|---|---|---|")
    for i, k in enumerate(r):
        print(f"| {i} | {k['name']} | {k['grid'][0]}x{k['grid'][1]} | {(k['start'] - t0) / 1e3:.2f} | "
              f"{(k['end'] - t0) / 1e3:.2f} | {(k['end'] - k['start']) / 1e3:.2f} | "
              f"{(k['end'] - prev_end) / 1e3:.2f} |")
        prev_end = k["end"]


def link_gaps(replays, copies, min_gap_ns=20_000):
    """Per replay: idle before its first expert copy, and within it, split by kernel."""
    big = sorted((c for c in copies if c["kind"] == 1 and c["bytes"] >= 1 << 20),
                 key=lambda c: c["start"])
    starts = [c["start"] for c in big]
    before, within, n_gaps, n_copies = [], [], [], []
    charged = collections.Counter()
    for r in replays:
        t0 = step_start(r)
        t1 = r[-1]["end"]
        lo, hi = bisect.bisect_left(starts, t0), bisect.bisect_right(starts, t1)
        cs = big[lo:hi]
        if not cs:
            continue
        n_copies.append(len(cs))
        before.append(cs[0]["start"] - t0)
        idle, gaps = 0, 0
        for a, b in zip(cs, cs[1:]):
            g0, g1 = a["end"], b["start"]
            if g1 - g0 < min_gap_ns:
                continue
            gaps += 1
            idle += g1 - g0
            prev = g0
            for k in r:
                if g0 < k["end"] <= g1:
                    charged[k["name"]] += k["end"] - max(prev, g0)
                    prev = k["end"]
            charged["(to the next copy's start)"] += g1 - prev
        within.append(idle)
        n_gaps.append(gaps)
    n = len(within)
    if not n:
        print("no expert copies inside the replays")
        return
    print(f"{n} replays with expert copies: {statistics.mean(n_copies):.1f} copies per step; idle "
          f"before the first copy {statistics.mean(before) / 1e3:.1f} us (median "
          f"{statistics.median(before) / 1e3:.1f}); within the step {statistics.mean(within) / 1e3:.1f} us "
          f"per step in {statistics.mean(n_gaps):.1f} gaps of {min_gap_ns / 1e3:.0f} us or more")
    print("| within a step's gaps: kernel | us per step |")
    print("|---|---|")
    for name, ns in charged.most_common():
        print(f"| {name} | {ns / n / 1e3:.1f} |")


def eager_summary(kernels):
    """Kernels launched outside graphs (prompt chunks, warm-up steps): per name, launches, summed
    duration, and the summed time charged as in a replay, counting only busy time (from the later
    of the previous kernel's end and the kernel's own start, so host idle is nobody's)."""
    eager = sorted((k for k in kernels if k["graph"] == 0), key=lambda k: k["end"])
    if not eager:
        sys.exit("report: no kernels outside graphs")
    rows = collections.defaultdict(lambda: [0, 0, 0])
    prev_end = eager[0]["start"]
    for k in eager:
        r = rows[k["name"]]
        r[0] += 1
        r[1] += k["end"] - k["start"]
        r[2] += max(0, k["end"] - max(prev_end, k["start"]))
        prev_end = max(prev_end, k["end"])
    busy = sum(r[2] for r in rows.values())
    print(f"eager kernels: {len(eager)}, busy {busy / 1e6:.2f} ms")
    print("| kernel | launches | duration ms | charged ms |")
    print("|---|---|---|---|")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        print(f"| {name} | {r[0]} | {r[1] / 1e6:.2f} | {r[2] / 1e6:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("trace_b", nargs="?")
    ap.add_argument("--graph", default="most")
    ap.add_argument("--nodes", action="store_true")
    ap.add_argument("--link-gaps", action="store_true")
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    if args.eager:
        eager_summary(read_trace(args.trace)[0])
        return

    results = []
    for path in [args.trace] + ([args.trace_b] if args.trace_b else []):
        kernels, copies = read_trace(path)
        graph, replays = replays_of(kernels, args.graph)
        if not replays:
            sys.exit(f"report: no complete replay of graph {graph} in {path}")
        span, rows = profile(replays)
        print(f"{path}: graph {graph}, {len(replays)} replays of {len(replays[0])} kernels, "
              f"median step {span:.1f} us; {len(copies)} copies")
        if args.nodes:
            print_nodes(replays)
        if args.link_gaps:
            link_gaps(replays, copies)
        results.append((span, rows))

    names = sorted(set().union(*(rows.keys() for _, rows in results)),
                   key=lambda n: -max(rows.get(n, (0, 0, 0))[2] for _, rows in results))
    if len(results) == 1:
        span, rows = results[0]
        print("| kernel | per step | median us | charged us per step |")
        print("|---|---|---|---|")
        for n in names:
            c, d, ch = rows[n]
            print(f"| {n} | {c} | {d:.2f} | {ch:.1f} |")
        print(f"| step | | | {span:.1f} |")
    else:
        (span_a, a), (span_b, b) = results
        print("| kernel | per step A / B | median us A / B | charged us A / B | B - A |")
        print("|---|---|---|---|---|")
        z = (0, 0.0, 0.0)
        for n in names:
            ca, da, cha = a.get(n, z)
            cb, db, chb = b.get(n, z)
            print(f"| {n} | {ca} / {cb} | {da:.2f} / {db:.2f} | {cha:.1f} / {chb:.1f} | {chb - cha:+.1f} |")
        print(f"| step | | | {span_a:.1f} / {span_b:.1f} | {span_b - span_a:+.1f} |")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        sys.stderr.close()
