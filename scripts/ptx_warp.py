"""A small PTX interpreter for one warp at a time: enough of PTX to run the routing kernels
(kernels/moe_route.cu) on a machine without a GPU. Used by scripts/check_route_ptx.py.

Registers hold bit patterns (Python ints). Lanes run independently between warp-collective
instructions (shfl.sync, vote.sync, bar.warp.sync), which run when every live lane reaches them
(a collective reached by some lanes only is an error). Arithmetic is IEEE-exact for the rounded
operations PTX defines (f32 via exact fractions, f64 via Python floats); ex2.approx is modelled
as the correctly rounded 2^x, so absolute results of expf may differ from a GPU's by an ulp, but
two kernels running the same operations get the same bits.

Counts: per lane, how often each instruction ran; the warp's count is, per instruction, the most
any lane ran it (divergent paths add up, convergent ones count once). These are PTX
instructions, not SASS: ptxas removes moves and conversions and adds address arithmetic.
"""
import math
import re
import struct
from fractions import Fraction

M32, M64 = (1 << 32) - 1, (1 << 64) - 1


def f32v(bits):
    return struct.unpack('<f', struct.pack('<I', bits & M32))[0]


def f64v(bits):
    return struct.unpack('<d', struct.pack('<Q', bits & M64))[0]


def f64b(x):
    return struct.unpack('<Q', struct.pack('<d', x))[0]


NAN32 = 0x7fffffff
NAN64 = 0x7fffffffffffffff


def round_f32(x, mode='rn'):
    """Exact value (Fraction, or float: inf / nan allowed) -> f32 bits; mode rn, rz, rm or rp."""
    if isinstance(x, float):
        if math.isnan(x):
            return NAN32
        if math.isinf(x):
            return 0x7f800000 if x > 0 else 0xff800000
        neg_zero = x == 0 and math.copysign(1, x) < 0
        x = Fraction(x)
        if x == 0:
            return 0x80000000 if neg_zero else 0
    if x == 0:
        return 0
    sign = x < 0
    a = -x if sign else x
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    e = max(e, -126)
    q = Fraction(2) ** (e - 23)
    m = a / q
    n = m.numerator // m.denominator
    rem = m - n
    if mode == 'rn':
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n & 1):
            n += 1
    elif mode == 'rm':
        if sign and rem > 0:
            n += 1
    elif mode == 'rp':
        if not sign and rem > 0:
            n += 1
    if n == 1 << 24:
        n >>= 1
        e += 1
    if e > 127:
        return (0xff800000 if sign else 0x7f800000)
    if n < (1 << 23):
        bits = n
    else:
        bits = ((e + 127) << 23) | (n - (1 << 23))
    return bits | (0x80000000 if sign else 0)


def ftz32(bits):
    return bits & 0x80000000 if (bits & 0x7f800000) == 0 else bits


def exact(bits, w=32):
    v = f32v(bits) if w == 32 else f64v(bits)
    return v if (math.isnan(v) or math.isinf(v)) else Fraction(v)


def sx(v, w):
    v &= (1 << w) - 1
    return v - (1 << w) if v >> (w - 1) else v


TYPE_W = {'u8': 8, 's8': 8, 'b8': 8, 'u16': 16, 's16': 16, 'b16': 16, 'u32': 32, 's32': 32,
          'b32': 32, 'f32': 32, 'u64': 64, 's64': 64, 'b64': 64, 'f64': 64, 'pred': 1}


def split_ops(s):
    out, depth, cur = [], 0, ''
    for ch in s:
        if ch in '{[':
            depth += 1
        elif ch in '}]':
            depth -= 1
        if ch == ',' and depth == 0:
            out.append(cur.strip())
            cur = ''
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class Kernel:
    def __init__(self, ptx_text, name_part):
        lines = ptx_text.split('\n')
        # module-level shared symbols
        self.shared_addr = {}
        addr = 0
        for ln in lines:
            m = re.match(r'\s*(?:\.extern\s+)?\.shared\s+\.align\s+(\d+)\s+\.b8\s+'
                         r'(\S+?)\[(\d*)\];', ln)
            if m:
                al, name, n = int(m.group(1)), m.group(2), int(m.group(3) or 0)
                addr = (addr + al - 1) // al * al
                self.shared_addr[name] = addr
                addr += n
        self.shared_static = addr
        # the entry
        start = next(i for i, ln in enumerate(lines) if '.entry' in ln and name_part in ln)
        self.name = re.search(r'\.entry\s+(\S+)\(', lines[start]).group(1)
        params, i = [], start + 1
        while not lines[i].strip().startswith('{'):
            m = re.search(r'\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+(\S+?)(\[(\d+)\])?,?$',
                          lines[i].strip())
            if m:
                size = int(m.group(4)) if m.group(4) else TYPE_W[m.group(1)] // 8
                params.append((m.group(2), size))
            i += 1
        self.params = params
        body, depth = [], 0
        for ln in lines[i:]:
            s = ln.split('//')[0].strip()
            if s == '{':
                depth += 1
                continue
            if s == '}':
                depth -= 1
                if depth == 0:
                    break
                continue
            if s:
                body.append(s)
        self.ins, self.labels = [], {}
        for s in body:
            if s.endswith(':'):
                self.labels[s[:-1]] = len(self.ins)
                continue
            if s.startswith('.') :
                continue
            s = s.rstrip(';').strip()
            pred = None
            m = re.match(r'@(!?)(%\w+)\s+(.*)', s)
            if m:
                pred = (m.group(1) == '!', m.group(2))
                s = m.group(3)
            parts = s.split(None, 1)
            op = parts[0]
            ops = split_ops(parts[1]) if len(parts) > 1 else []
            self.ins.append((pred, op, ops))


class Warp:
    def __init__(self, kernel, param_bytes, gmem, shared, tids, ctaid):
        self.k = kernel
        self.param = {}
        for (name, size), data in zip(kernel.params, param_bytes):
            self.param[name] = bytes(data).ljust(size, b'\0')
        self.g = gmem
        self.s = shared
        self.regs = [dict() for _ in tids]
        self.tids = tids
        self.ctaid = ctaid
        self.counts = [dict() for _ in tids]

    # memory: gmem is a dict base -> bytearray
    def gbuf(self, addr):
        for base, buf in self.g.items():
            if base <= addr < base + len(buf):
                return buf, addr - base
        raise RuntimeError('bad global address %x' % addr)

    def load(self, space, addr, nbytes):
        if space == 'shared':
            return bytes(self.s[addr:addr + nbytes])
        if space == 'global':
            buf, off = self.gbuf(addr)
            return bytes(buf[off:off + nbytes])
        raise RuntimeError(space)

    def store(self, space, addr, data):
        if space == 'shared':
            self.s[addr:addr + len(data)] = data
        else:
            buf, off = self.gbuf(addr)
            buf[off:off + len(data)] = data

    def val(self, lane, o, w=32):
        r = self.regs[lane]
        neg = False
        if o.startswith('!'):
            neg, o = True, o[1:]
        if o.startswith('%'):
            if o == '%tid.x':
                return self.tids[lane]
            if o == '%ctaid.x':
                return self.ctaid
            if o == '%ntid.x':
                return 128
            if o == '%laneid':
                return self.tids[lane] % 32
            v = r.get(o, 0)
            return (1 - v) if neg else v
        if o.startswith('0f'):
            return int(o[2:], 16)
        if o.startswith('0d'):
            return int(o[2:], 16)
        if o in self.k.shared_addr:
            return self.k.shared_addr[o]
        if re.match(r'-?(0x[0-9a-fA-F]+|\d+)$', o):
            return int(o, 0) & ((1 << w) - 1)
        raise RuntimeError('operand ' + o)

    def addr(self, lane, o):
        m = re.match(r'\[([^\]+]+)(?:\+(-?\d+))?\]', o)
        base, off = m.group(1), int(m.group(2) or 0)
        if base in self.param:
            return ('param', base, off)
        return self.val(lane, base, 64) + off

    def set(self, lane, d, v):
        self.regs[lane][d] = v

    def run(self):
        n = len(self.tids)
        pc = [0] * n
        done = [False] * n
        k = self.k
        while not all(done):
            waiting = []
            for l in range(n):
                if done[l]:
                    continue
                while True:
                    pred, op, ops = k.ins[pc[l]]
                    if op.startswith(('shfl.sync', 'vote.sync', 'bar.warp.sync')):
                        waiting.append(l)
                        break
                    self.counts[l][pc[l]] = self.counts[l].get(pc[l], 0) + 1
                    if pred is not None:
                        pv = self.regs[l].get(pred[1], 0)
                        if pred[0]:
                            pv = 1 - pv
                        if not pv:
                            pc[l] += 1
                            continue
                    if op in ('ret', 'exit'):
                        done[l] = True
                        break
                    if op.startswith('bra'):
                        pc[l] = k.labels[ops[0]]
                        continue
                    self.exec1(l, op, ops)
                    pc[l] += 1
            if not waiting:
                continue
            live = [l for l in range(n) if not done[l]]
            assert sorted(waiting) == live, 'divergent collective'
            p0 = pc[waiting[0]]
            assert all(pc[l] == p0 for l in waiting), 'collectives at different places'
            pred, op, ops = k.ins[p0]
            for l in waiting:
                self.counts[l][p0] = self.counts[l].get(p0, 0) + 1
            active = [l for l in waiting
                      if pred is None or (self.regs[l].get(pred[1], 0) ^ pred[0])]
            if op.startswith('shfl.sync.bfly'):
                dst = ops[0].split('|')
                src = {l: self.val(l, ops[1]) for l in active}
                lane_of = {self.tids[l] % 32: l for l in active}
                for l in active:
                    other = (self.tids[l] % 32) ^ self.val(l, ops[2])
                    ol = lane_of.get(other, l)
                    self.set(l, dst[0], src[ol])
                    if len(dst) > 1:
                        self.set(l, dst[1], 1)
            elif op.startswith('shfl.sync.idx'):
                dst = ops[0].split('|')
                src = {l: self.val(l, ops[1]) for l in active}
                lane_of = {self.tids[l] % 32: l for l in active}
                for l in active:
                    ol = lane_of.get(self.val(l, ops[2]) & 31, l)
                    self.set(l, dst[0], src[ol])
                    if len(dst) > 1:
                        self.set(l, dst[1], 1)
            elif op.startswith('vote.sync.ballot'):
                m = 0
                for l in active:
                    if self.val(l, ops[1]):
                        m |= 1 << (self.tids[l] % 32)
                for l in active:
                    self.set(l, ops[0], m)
            elif op.startswith('vote.sync.any'):
                a = any(self.val(l, ops[1]) for l in active)
                for l in active:
                    self.set(l, ops[0], int(a))
            for l in waiting:
                pc[l] += 1

    def warp_count(self):
        pcs = set()
        for c in self.counts:
            pcs |= set(c)
        return sum(max(c.get(p, 0) for c in self.counts) for p in pcs)

    # one instruction, one lane
    def exec1(self, l, op, ops):
        parts = op.split('.')
        root = parts[0]
        typ = parts[-1]
        w = TYPE_W.get(typ, 32)
        V = lambda o, ww=w: self.val(l, o, ww)
        S = lambda v: self.set(l, ops[0], v)
        if root == 'mov':
            if ops[0].startswith('{'):  # unpack
                regs = [x.strip() for x in ops[0][1:-1].split(',')]
                v = V(ops[1], 64)
                hw = 64 // len(regs)
                for i, r in enumerate(regs):
                    self.set(l, r, (v >> (hw * i)) & ((1 << hw) - 1))
            elif ops[1].startswith('{'):
                regs = [x.strip() for x in ops[1][1:-1].split(',')]
                hw = w // len(regs)
                v = 0
                for i, r in enumerate(regs):
                    v |= V(r) << (hw * i)
                S(v)
            else:
                S(V(ops[1]) & ((1 << w) - 1) if typ != 'pred' else V(ops[1]))
        elif root == 'ld':
            space = parts[1]
            vec = 1
            if parts[2].startswith('v'):
                vec = int(parts[2][1:])
            nb = TYPE_W[typ] // 8
            a = self.addr(l, ops[1])
            if space == 'param':
                _, name, off = a
                data = self.param[name][off:off + nb * vec]
            else:
                data = self.load(space, a, nb * vec)
            regs = [x.strip() for x in ops[0][1:-1].split(',')] if vec > 1 else [ops[0]]
            for i, r in enumerate(regs):
                v = int.from_bytes(data[i * nb:(i + 1) * nb], 'little')
                if typ.startswith('s') and nb < 4:
                    v = sx(v, nb * 8) & M32
                if r != '_':
                    self.set(l, r, v)
        elif root == 'st':
            space = parts[1]
            vec = int(parts[2][1:]) if parts[2].startswith('v') else 1
            nb = TYPE_W[typ] // 8
            a = self.addr(l, ops[0])
            regs = [x.strip() for x in ops[1][1:-1].split(',')] if vec > 1 else [ops[1]]
            mask = (1 << (nb * 8)) - 1
            data = b''.join((V(r, nb * 8) & mask).to_bytes(nb, 'little') for r in regs)
            self.store(space, a, data)
        elif root == 'cvta':
            S(V(ops[1], 64))
        elif root in ('add', 'sub', 'mul', 'mad', 'fma', 'div', 'rem', 'max', 'min', 'neg', 'rcp',
                      'ex2', 'abs') and typ in ('f32', 'f64'):
            self.float_op(l, root, parts, typ, ops)
        elif root in ('add', 'sub'):
            a, b = V(ops[1]), V(ops[2])
            S((a + b if root == 'add' else a - b) & ((1 << w) - 1))
        elif root == 'mul':
            if parts[1] == 'wide':
                sw = typ.startswith('s')
                a, b = V(ops[1]), V(ops[2])
                if sw:
                    a, b = sx(a, 32), sx(b, 32)
                self.set(l, ops[0], (a * b) & M64)
            else:
                a, b = V(ops[1]), V(ops[2])
                S((a * b) & ((1 << w) - 1))
        elif root == 'mad':
            a, b, c = V(ops[1]), V(ops[2]), V(ops[3])
            S((a * b + c) & ((1 << w) - 1))
        elif root in ('div', 'rem'):
            a, b = V(ops[1]), V(ops[2])
            if typ.startswith('s'):
                a, b = sx(a, w), sx(b, w)
                q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)
                r = a - q * b
            else:
                q, r = a // b, a % b
            S((q if root == 'div' else r) & ((1 << w) - 1))
        elif root in ('max', 'min'):
            a, b = V(ops[1]), V(ops[2])
            if typ.startswith('s'):
                a2, b2 = sx(a, w), sx(b, w)
            else:
                a2, b2 = a, b
            S(a if (a2 >= b2) == (root == 'max') else b)
        elif root in ('and', 'or', 'xor'):
            a, b = V(ops[1]), V(ops[2])
            S({'and': a & b, 'or': a | b, 'xor': a ^ b}[root])
        elif root == 'not':
            S((~V(ops[1])) & (1 if typ == 'pred' else (1 << w) - 1))
        elif root == 'shl':
            a, b = V(ops[1]), V(ops[2], 32)
            S((a << min(b, w)) & ((1 << w) - 1))
        elif root == 'shr':
            a, b = V(ops[1]), V(ops[2], 32)
            if typ.startswith('s'):
                S((sx(a, w) >> min(b, w - 1)) & ((1 << w) - 1))
            else:
                S(a >> min(b, w))
        elif root == 'shf':
            a, b, c = V(ops[1]), V(ops[2]), V(ops[3]) & 31
            S((((b << 32 | a) << c) >> 32) & M32)
        elif root == 'bfi':
            a, b, pos, ln = V(ops[1]), V(ops[2]), V(ops[3], 32), V(ops[4], 32)
            m = ((1 << ln) - 1) << pos
            S((b & ~m | (a << pos) & m) & ((1 << w) - 1))
        elif root == 'popc':
            S(bin(V(ops[1])).count('1'))
        elif root == 'brev':
            S(int('{:032b}'.format(V(ops[1]))[::-1], 2))
        elif root == 'bfind':
            a = V(ops[1])
            if a == 0:
                S(M32)
            else:
                msb = a.bit_length() - 1
                S(31 - msb if 'shiftamt' in parts else msb)
        elif root == 'selp':
            S(V(ops[1]) if V(ops[3], 1) else V(ops[2]))
        elif root == 'setp':
            self.setp(l, parts, ops)
        elif root == 'cvt':
            self.cvt(l, parts, ops)
        else:
            raise RuntimeError('op ' + op)

    def float_op(self, l, root, parts, typ, ops):
        w = 32 if typ == 'f32' else 64
        V = lambda o: self.val(l, o, w)
        S = lambda v: self.set(l, ops[0], v)
        ftz = 'ftz' in parts
        mode = next((p for p in parts if p in ('rn', 'rz', 'rm', 'rp')), 'rn')

        def inp(o):
            b = V(o)
            if w == 32 and ftz:
                b = ftz32(b)
            return b
        if root == 'neg':
            S(V(ops[1]) ^ (1 << (w - 1)))
            return
        if root == 'abs':
            S(V(ops[1]) & ((1 << (w - 1)) - 1))
            return
        if root in ('max', 'min'):
            a, b = inp(ops[1]), inp(ops[2])
            fa, fb = (f32v(a), f32v(b)) if w == 32 else (f64v(a), f64v(b))
            if math.isnan(fa):
                S(b if not math.isnan(fb) else (NAN32 if w == 32 else NAN64))
                return
            if math.isnan(fb):
                S(a)
                return
            if fa == fb:  # +0 wins for max, -0 for min
                sa = a >> (w - 1)
                S((a if sa == 0 else b) if root == 'max' else (a if sa else b))
                return
            S(a if (fa > fb) == (root == 'max') else b)
            return
        if w == 64:
            a = f64v(V(ops[1]))
            if root == 'rcp':
                r = 1.0 / a if a != 0 else math.copysign(math.inf, a)
            else:
                b = f64v(V(ops[2]))
                if root == 'add':
                    r = a + b
                elif root == 'sub':
                    r = a - b
                elif root == 'mul':
                    r = a * b
                elif root == 'div':
                    if b != 0:
                        r = a / b
                    elif a == 0 or math.isnan(a):
                        r = math.nan
                    else:
                        r = math.copysign(math.inf, a) * math.copysign(1, b)
                elif root in ('fma',):
                    r = float(Fraction(a) * Fraction(b) + Fraction(f64v(V(ops[3]))))
                else:
                    raise RuntimeError(root)
            S(NAN64 if math.isnan(r) else f64b(r))
            return
        # f32
        if root == 'ex2':
            x = f32v(inp(ops[1]))
            try:
                r = 2.0 ** x
            except OverflowError:
                r = math.inf
            S(ftz32(round_f32(r)))
            return
        if root == 'rcp':
            x = exact(inp(ops[1]))
            if isinstance(x, float):  # inf or nan
                S(round_f32(1 / x if math.isinf(x) else x, mode))
            elif x == 0:
                S(0x7f800000 | (inp(ops[1]) & 0x80000000))
            else:
                S(round_f32(1 / x, mode))
            return
        a, b = exact(inp(ops[1])), exact(inp(ops[2]))
        c = exact(inp(ops[3])) if root in ('fma', 'mad') else Fraction(0)
        if any(isinstance(x, float) for x in (a, b, c)):
            fa, fb, fc = float(a), float(b), float(c)
            r = {'add': lambda: fa + fb, 'sub': lambda: fa - fb, 'mul': lambda: fa * fb,
                 'div': lambda: fa / fb if fb else math.nan,
                 'fma': lambda: fa * fb + fc, 'mad': lambda: fa * fb + fc}[root]()
            bits = round_f32(float(r), mode)
        else:
            if root == 'add':
                r = a + b
            elif root == 'sub':
                r = a - b
            elif root == 'mul':
                r = a * b
            elif root in ('fma', 'mad'):
                r = a * b + c
            elif root == 'div':
                r = a / b if b != 0 else None
            bits = round_f32(r, mode) if r is not None else NAN32
            if r == 0:  # the sign of an exact zero (IEEE 754, 6.3)
                sa, sb = self.val(l, ops[1], 32) >> 31, self.val(l, ops[2], 32) >> 31
                if root == 'mul':
                    bits = (sa ^ sb) << 31
                elif root in ('add', 'sub'):
                    sb ^= root == 'sub'
                    both_zero = a == 0 and b == 0
                    neg = (sa and sb) if both_zero else mode == 'rm'
                    bits = int(neg) << 31
                elif root in ('fma', 'mad'):
                    sp = sa ^ sb
                    sc = self.val(l, ops[3], 32) >> 31
                    both_zero = a * b == 0 and c == 0
                    neg = (sp and sc) if both_zero else mode == 'rm'
                    bits = int(neg) << 31
        if ftz:
            bits = ftz32(bits)
        S(bits)

    def setp(self, l, parts, ops):
        cmp_, typ = parts[1], parts[-1]
        boolop = parts[2] if len(parts) > 3 and parts[2] in ('and', 'or', 'xor') else None
        w = TYPE_W[typ]
        a, b = self.val(l, ops[1], w), self.val(l, ops[2], w)
        if typ.startswith('f'):
            fa, fb = (f32v(a), f32v(b)) if w == 32 else (f64v(a), f64v(b))
            nan = math.isnan(fa) or math.isnan(fb)
            r = {'eq': fa == fb, 'ne': fa != fb and not nan, 'lt': fa < fb, 'le': fa <= fb,
                 'gt': fa > fb, 'ge': fa >= fb, 'equ': nan or fa == fb, 'neu': nan or fa != fb,
                 'ltu': nan or fa < fb, 'leu': nan or fa <= fb, 'gtu': nan or fa > fb,
                 'geu': nan or fa >= fb, 'num': not nan, 'nan': nan}[cmp_]
        else:
            if typ.startswith('s'):
                a, b = sx(a, w), sx(b, w)
            r = {'eq': a == b, 'ne': a != b, 'lt': a < b, 'le': a <= b, 'gt': a > b, 'ge': a >= b,
                 'lo': a < b, 'ls': a <= b, 'hi': a > b, 'hs': a >= b}[cmp_]
        r = int(r)
        dsts = ops[0].split('|')
        if boolop:
            c = self.val(l, ops[3], 1)
            f = {'and': lambda x: x & c, 'or': lambda x: x | c, 'xor': lambda x: x ^ c}[boolop]
            self.set(l, dsts[0], f(r))
            if len(dsts) > 1:
                self.set(l, dsts[1], f(1 - r))
        else:
            self.set(l, dsts[0], r)
            if len(dsts) > 1:
                self.set(l, dsts[1], 1 - r)

    def cvt(self, l, parts, ops):
        mods = [p for p in parts[1:-2]]
        dt, st = parts[-2], parts[-1]
        sw, dw = TYPE_W[st], TYPE_W[dt]
        v = self.val(l, ops[1], sw)
        mode = next((p for p in mods if p in ('rn', 'rz', 'rm', 'rp')), 'rn')
        if dt == 'f32' and st == 'f32':
            x = f32v(v)
            if 'sat' in mods:
                x = 0.0 if math.isnan(x) else min(max(x, 0.0), 1.0)
                r = round_f32(x)
                if 'ftz' in mods:
                    r = ftz32(r)
                self.set(l, ops[0], r)
                return
            self.set(l, ops[0], v)
            return
        if dt == 'f64' and st == 'f32':
            self.set(l, ops[0], f64b(f32v(v)) if not math.isnan(f32v(v)) else NAN64)
            return
        if dt == 'f32' and st == 'f64':
            x = f64v(v)
            if x == 0:
                self.set(l, ops[0], 0x80000000 if math.copysign(1, x) < 0 else 0)
            else:
                finite = not (math.isnan(x) or math.isinf(x))
                self.set(l, ops[0], round_f32(Fraction(x) if finite else x, mode))
            return
        if dt.startswith('f') or st.startswith('f'):
            raise RuntimeError('cvt ' + '.'.join(parts))
        # integer
        if st.startswith('s'):
            v = sx(v, sw)
        self.set(l, ops[0], v & ((1 << dw) - 1))
