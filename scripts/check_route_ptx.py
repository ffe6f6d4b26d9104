#!/usr/bin/env python3
"""Routing kernels without a GPU: runs the PTX of kernels/moe_route.cu as it is now and as it
was at a reference revision (default main) in a one-warp interpreter (scripts/ptx_warp.py), on
the same rows, and checks that ids, weights and probs are the same bits, and that the ids follow
the CPU rule (higher probability first, then the lower id; group-limited as mgl's moe_topk).
Prints the PTX instructions one token's warp executes in each version.

    scripts/check_route_ptx.py [--ref REV] [--tokens T] [--seed S] [--kinds random,levels,...]

Needs nvcc (PTX only, nothing runs on a device). The RouteArgs layout of each version is taken
from its source (with or without group_recip). Slow: a few minutes for the whole set.
"""
import argparse
import functools
import math
import os
import random
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ptx_warp import Kernel, Warp, f32v  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ('random', 'levels', 'all_equal', 'straddle', 'specials', 'by_lane')
# (E, k, group-limited, n_group, topk_group, norm_topk_prob)
CONFIGS = [(64, 6, False, 1, 1, False), (64, 6, True, 8, 3, False), (160, 6, True, 8, 3, False),
           (256, 8, True, 8, 4, True), (256, 8, False, 1, 1, True), (64, 6, True, 8, 3, True),
           (7, 3, False, 1, 1, True), (32, 32, False, 1, 1, True), (33, 6, False, 1, 1, False),
           (40, 6, True, 8, 3, False), (72, 4, True, 9, 2, True), (100, 6, False, 1, 1, True),
           (200, 6, True, 8, 3, True), (255, 8, False, 1, 1, False), (64, 32, False, 1, 1, False),
           (64, 64, False, 1, 1, True), (96, 12, False, 1, 1, False), (16, 4, True, 4, 1, False),
           (96, 2, True, 32, 5, False), (6, 2, True, 3, 1, False), (160, 12, False, 1, 1, True)]


def f32(x):
    return f32v(struct.unpack('<I', struct.pack('<f', x))[0])


def ptx_of(source_text, workdir, name):
    src = os.path.join(workdir, name + '.cu')
    with open(src, 'w') as f:
        f.write(source_text)
    out = os.path.join(workdir, name + '.ptx')
    nvcc = os.environ.get('NVCC', '/usr/local/cuda/bin/nvcc')
    subprocess.run([nvcc, '-DMINIDS_HAVE_CUDA=1', '-I' + os.path.join(ROOT, 'kernels'),
                    '-I' + os.path.join(ROOT, 'ggml-like', 'include'), '-O3', '-DNDEBUG',
                    '-arch=sm_90', '--expt-relaxed-constexpr', '-std=c++20', '-ptx', src,
                    '-o', out], check=True)
    with open(out) as f:
        return f.read()


class Version:
    """One version of moe_route.cu: its kernels and its RouteArgs layout."""

    def __init__(self, source_text, ptx):
        self.has_recip = 'group_recip' in source_text
        self.route = Kernel(ptx, '12route_kernel')
        self.rank = {}
        for nb in range(1, 9):
            try:
                self.rank[nb] = Kernel(ptx, 'route_rank_kernelILi%dE' % nb)
            except StopIteration:
                pass

    def kernel(self, E, k):
        chunks = (E + 31) // 32
        if chunks in self.rank and min(k, 32) * chunks <= 64:
            return self.rank[chunks]
        return self.route

    def args(self, inp, softmax, probs_out, ids, weights, T, E, k, grouped, ng, tg, norm, scale):
        b = struct.pack('<QQqQQQqii', inp if softmax else 0, 0 if softmax else inp, E, probs_out,
                        ids, weights, T, E, k)
        b += struct.pack('<?3xii', grouped, ng, tg)
        if self.has_recip:
            gs = E // ng
            b += struct.pack('<I', ((1 << 20) + gs - 1) // gs if grouped else 0)
        b += struct.pack('<?3xf', norm and k > 1, scale)
        return b.ljust(88, b'\0')

    def run(self, rows, E, k, grouped, ng, tg, norm, scale, softmax):
        T = len(rows)
        IN, PO, ID, W = 0x10000000, 0x20000000, 0x30000000, 0x40000000
        g = {IN: bytearray(struct.pack('<%df' % (T * E), *[x for r in rows for x in r])),
             PO: bytearray(b'\xee' * (4 * T * E)), ID: bytearray(b'\xee' * (4 * T * k)),
             W: bytearray(b'\xee' * (4 * T * k))}
        a = self.args(IN, softmax, PO, ID, W, T, E, k, grouped, ng, tg, norm, scale)
        kern = self.kernel(E, k)
        counts = []
        for t in range(T):  # 4 tokens per block, one warp each
            w = Warp(kern, [a, bytes([softmax])], g, bytearray(64 * 1024),
                     [(t % 4) * 32 + lane for lane in range(32)], t // 4)
            w.run()
            counts.append(w.warp_count())
        ids = list(struct.unpack('<%di' % (T * k), bytes(g[ID])))
        return ids, bytes(g[W]), bytes(g[PO]), counts


def cpu_topk(p, E, k, grouped, ng, tg):
    """ggml-like/cpu/ops_moe.cpp's run_moe_topk for one row."""
    def before(a, b):
        return p[a] > p[b] or (p[a] == p[b] and a < b)
    order = list(range(E))
    if grouped:
        gs = E // ng
        score = [-math.inf] * ng
        for e in range(E):
            s = score[e // gs]
            score[e // gs] = p[e] if s < p[e] else s  # std::max
        groups = sorted(range(ng), key=functools.cmp_to_key(
            lambda a, b: -1 if (score[a] > score[b] or (score[a] == score[b] and a < b)) else 1))
        kept = set(groups[:tg])
        order = [e for e in order if e // gs in kept]
    order.sort(key=functools.cmp_to_key(
        lambda a, b: -1 if before(a, b) else (1 if before(b, a) else 0)))
    return order[:k]


def row_of(kind, E, k, logits, rng):
    """As tests/test_kernels_moe.cpp's rows_of (other random draws)."""
    row = []
    for e in range(E):
        u = rng.uniform(-4, 4) if logits else rng.uniform(0, 1)
        if kind == 'levels':
            v = float(1 + rng.randrange(4)) / (1 if logits else 64)
        elif kind == 'all_equal':
            v = 0.0 if logits else 0.25
        elif kind == 'specials':
            special = e % 2 == 0 and rng.randrange(2)
            specials = [-math.inf, 0.0, -0.0] if logits else [
                0.0, -0.0, 2.0**-140, 2.0**-149, -2.0**-149, -0.5]
            v = rng.choice(specials) if special else u
        elif kind == 'by_lane':
            v = float((32 - e % 32) * 8 - e // 32) / (64.0 if logits else 512.0)
        else:
            v = u
        row.append(f32(v))
    if kind == 'straddle' and k < E:
        order = sorted(range(E), key=lambda e: -row[e])
        row[order[k]] = row[order[k - 1]]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--ref', default='main')
    ap.add_argument('--tokens', type=int, default=1)
    ap.add_argument('--seed', type=int, default=0)
    ap.add_argument('--kinds', default=','.join(KINDS))
    args = ap.parse_args()
    with open(os.path.join(ROOT, 'kernels', 'moe_route.cu')) as f:
        cur_src = f.read()
    ref_src = subprocess.run(['git', '-C', ROOT, 'show', args.ref + ':kernels/moe_route.cu'],
                             check=True, capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        cur = Version(cur_src, ptx_of(cur_src, tmp, 'current'))
        ref = Version(ref_src, ptx_of(ref_src, tmp, 'reference'))
    rng = random.Random(args.seed)
    runs = bad = 0
    print('PTX instructions one token\'s warp executes (random logits):\n')
    print('| E | k | rule | %s | current |\n|---|---|---|---|---|' % args.ref)
    for (E, k, grouped, ng, tg, norm) in CONFIGS:
        for kind in args.kinds.split(','):
            for softmax in (True, False):
                rows = [row_of(kind, E, k, softmax, rng) for _ in range(args.tokens)]
                o = ref.run(rows, E, k, grouped, ng, tg, norm, 16.0, softmax)
                n = cur.run(rows, E, k, grouped, ng, tg, norm, 16.0, softmax)
                runs += 1
                probs = rows
                if softmax:
                    probs = [struct.unpack('<%df' % E, n[2][4 * E * t:4 * E * (t + 1)])
                             for t in range(len(rows))]
                want = [i for p in probs for i in cpu_topk(p, E, k, grouped, ng, tg)]
                if o[:3] != n[:3] or n[0] != want:
                    bad += 1
                    print('MISMATCH E=%d k=%d grouped=%s %d/%d norm=%s %s softmax=%s: ids %s / %s '
                          '(CPU rule %s), weights %s, probs %s' % (
                              E, k, grouped, ng, tg, norm, kind, softmax, o[0], n[0], want,
                              'same' if o[1] == n[1] else 'differ',
                              'same' if o[2] == n[2] else 'differ'))
                elif kind == 'random' and softmax:
                    rule = 'group-limited %d/%d' % (ng, tg) if grouped else 'greedy'
                    rule += ', normalized' if norm else ''
                    print('| %d | %d | %s | %d | %d |' % (E, k, rule, o[3][0], n[3][0]))
    print('%d runs, %d mismatches' % (runs, bad))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
