#include "routing/npz.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>

namespace minids::routing {

namespace {

constexpr std::array<uint32_t, 256> make_crc_table() {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
        uint32_t c = i;
        for (int b = 0; b < 8; ++b) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        t[i] = c;
    }
    return t;
}
constexpr auto crc_table = make_crc_table();

uint64_t read_le(std::span<const std::byte> b, size_t at, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | uint64_t(b[at + size_t(i)]);
    return v;
}

void put_le(std::vector<std::byte>& out, uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out.push_back(std::byte((v >> (8 * i)) & 0xFF));
}

// A strict reader of the Python dict literal in a .npy header.
class HeaderParser {
public:
    HeaderParser(std::string_view s, const std::string& what) : s_(s), what_(what) {}

    void parse(std::string& descr, bool& fortran, std::vector<int64_t>& shape) {
        bool have_descr = false, have_fortran = false, have_shape = false;
        expect('{');
        while (!peek('}')) {
            const std::string key = string_literal();
            expect(':');
            if (key == "descr" && !have_descr) {
                descr = string_literal();
                have_descr = true;
            } else if (key == "fortran_order" && !have_fortran) {
                fortran = boolean();
                have_fortran = true;
            } else if (key == "shape" && !have_shape) {
                shape = tuple();
                have_shape = true;
            } else {
                fail("unexpected or repeated key '" + key + "'");
            }
            if (!peek('}')) expect(',');
        }
        expect('}');
        skip_space();
        if (pos_ != s_.size()) fail("text after the closing brace");
        if (!have_descr || !have_fortran || !have_shape)
            fail("expected the keys descr, fortran_order and shape");
    }

private:
    [[noreturn]] void fail(const std::string& why) const {
        throw TraceError(what_ + ": malformed .npy header (" + why + ")");
    }
    void skip_space() {
        while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n')) ++pos_;
    }
    bool peek(char c) {
        skip_space();
        return pos_ < s_.size() && s_[pos_] == c;
    }
    void expect(char c) {
        if (!peek(c)) fail(std::string("expected '") + c + "'");
        ++pos_;
    }
    std::string string_literal() {
        skip_space();
        if (pos_ >= s_.size() || (s_[pos_] != '\'' && s_[pos_] != '"')) fail("expected a string");
        const char q = s_[pos_++];
        const size_t end = s_.find(q, pos_);
        if (end == std::string_view::npos || end - pos_ > 64) fail("unterminated string");
        std::string v(s_.substr(pos_, end - pos_));
        pos_ = end + 1;
        return v;
    }
    bool boolean() {
        skip_space();
        if (s_.substr(pos_, 4) == "True") return pos_ += 4, true;
        if (s_.substr(pos_, 5) == "False") return pos_ += 5, false;
        fail("expected True or False");
    }
    std::vector<int64_t> tuple() {
        std::vector<int64_t> dims;
        expect('(');
        while (!peek(')')) {
            skip_space();
            int64_t v = 0;
            size_t digits = 0;
            while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
                if (++digits > 15) fail("dimension too large");
                v = v * 10 + (s_[pos_++] - '0');
            }
            if (digits == 0) fail("expected a non-negative integer dimension");
            if (dims.size() >= 8) fail("more than 8 dimensions");
            dims.push_back(v);
            if (!peek(')')) expect(',');
        }
        expect(')');
        return dims;
    }

    std::string_view s_;
    const std::string& what_;
    size_t pos_ = 0;
};

int64_t itemsize_of(const std::string& descr, const std::string& what) {
    if (descr.size() < 3 || (descr[0] != '<' && descr[0] != '|') ||
        std::string("iufb").find(descr[1]) == std::string::npos) {
        throw TraceError(what + ": unsupported dtype '" + descr +
                         "' (expected little-endian integers, floats or bools)");
    }
    const std::string n = descr.substr(2);
    if (n != "1" && n != "2" && n != "4" && n != "8") {
        throw TraceError(what + ": unsupported dtype '" + descr + "'");
    }
    return std::stoll(n);
}

}  // namespace

uint32_t crc32(std::span<const std::byte> data, uint32_t crc) {
    crc = ~crc;
    for (std::byte b : data) crc = crc_table[(crc ^ uint32_t(b)) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

int64_t NpyView::n_elements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

NpyView parse_npy(std::span<const std::byte> b, const std::string& what) {
    static const unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
    if (b.size() < 10 || std::memcmp(b.data(), magic, 6) != 0) {
        throw TraceError(what + ": not a .npy array (bad magic or truncated)");
    }
    const int major = int(b[6]);
    size_t header_len = 0, header_at = 0;
    if (major == 1) {
        header_len = size_t(read_le(b, 8, 2));
        header_at = 10;
    } else if (major == 2 || major == 3) {
        if (b.size() < 12) throw TraceError(what + ": truncated .npy header");
        header_len = size_t(read_le(b, 8, 4));
        header_at = 12;
    } else {
        throw TraceError(what + ": unsupported .npy version " + std::to_string(major));
    }
    if (header_len > b.size() - header_at) throw TraceError(what + ": truncated .npy header");
    const std::string_view header(reinterpret_cast<const char*>(b.data() + header_at), header_len);
    NpyView v;
    bool fortran = false;
    HeaderParser(header, what).parse(v.descr, fortran, v.shape);
    if (fortran) throw TraceError(what + ": Fortran-ordered arrays are not supported");
    const int64_t item = itemsize_of(v.descr, what);
    const size_t data_at = header_at + header_len;
    const uint64_t have = b.size() - data_at;
    uint64_t need = uint64_t(item);
    for (int64_t d : v.shape) {
        if (d != 0 && need > std::numeric_limits<uint64_t>::max() / uint64_t(d)) {
            throw TraceError(what + ": shape too large");
        }
        need *= uint64_t(d);
    }
    if (need != have) {
        throw TraceError(what + ": expected " + std::to_string(need) +
                         " bytes of data for its shape, found " + std::to_string(have));
    }
    v.data = b.subspan(data_at);
    return v;
}

std::vector<std::byte> make_npy(const std::string& descr, const std::vector<int64_t>& shape,
                                std::span<const std::byte> data) {
    std::string dims;
    for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
    if (shape.size() == 1) dims += ",";
    std::string header =
        "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
    const size_t unpadded = 10 + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
    header.push_back('\n');
    std::vector<std::byte> out;
    out.reserve(10 + header.size() + data.size());
    for (int c : {0x93, int('N'), int('U'), int('M'), int('P'), int('Y'), 1, 0})
        out.push_back(std::byte(c));
    put_le(out, header.size(), 2);
    for (char c : header) out.push_back(std::byte(c));
    out.insert(out.end(), data.begin(), data.end());
    return out;
}

NpzArchive NpzArchive::read(const std::string& path) {
    std::ifstream f(path, std::ios::binary | std::ios::ate);
    if (!f) throw TraceError("trace " + path + ": cannot open: " + std::strerror(errno));
    const std::streamoff size = f.tellg();
    if (size < 0) throw TraceError("trace " + path + ": cannot read");
    std::vector<std::byte> bytes(static_cast<size_t>(size));
    f.seekg(0);
    f.read(reinterpret_cast<char*>(bytes.data()), size);
    if (!f) throw TraceError("trace " + path + ": cannot read");
    return from_bytes(std::move(bytes), path);
}

NpzArchive NpzArchive::from_bytes(std::vector<std::byte> bytes, const std::string& name) {
    NpzArchive a;
    a.path_ = name;
    a.bytes_ = std::move(bytes);
    const std::span<const std::byte> b(a.bytes_);
    const std::string where = "trace " + name;
    auto fail = [&](const std::string& why) -> void { throw TraceError(where + ": " + why); };

    // The end-of-central-directory record: 22 bytes plus a comment of up to 65535 bytes.
    if (b.size() < 22) fail("not a trace (.npz) file: too short or truncated");
    size_t eocd = std::string::npos;
    const size_t lowest = b.size() > 22 + 65535 ? b.size() - 22 - 65535 : 0;
    for (size_t p = b.size() - 22 + 1; p-- > lowest;) {
        if (read_le(b, p, 4) == 0x06054b50 && p + 22 + read_le(b, p + 20, 2) == b.size()) {
            eocd = p;
            break;
        }
    }
    if (eocd == std::string::npos) fail("not a trace (.npz) file: no zip directory (truncated?)");
    const uint64_t n_entries = read_le(b, eocd + 10, 2);
    const uint64_t cd_size = read_le(b, eocd + 12, 4);
    const uint64_t cd_at = read_le(b, eocd + 16, 4);
    if (read_le(b, eocd + 4, 4) != 0 || read_le(b, eocd + 8, 2) != n_entries)
        fail("multi-part zip archives are not supported");
    if (cd_at > eocd || cd_size > eocd - cd_at) fail("zip directory outside the file");

    size_t p = size_t(cd_at);
    const size_t cd_end = size_t(cd_at + cd_size);
    for (uint64_t i = 0; i < n_entries; ++i) {
        if (cd_end - p < 46 || read_le(b, p, 4) != 0x02014b50) fail("corrupt zip directory");
        const uint64_t flags = read_le(b, p + 8, 2);
        const uint64_t method = read_le(b, p + 10, 2);
        const uint32_t crc = uint32_t(read_le(b, p + 16, 4));
        uint64_t csize = read_le(b, p + 20, 4);
        uint64_t usize = read_le(b, p + 24, 4);
        const size_t name_len = size_t(read_le(b, p + 28, 2));
        const size_t extra_len = size_t(read_le(b, p + 30, 2));
        const size_t comment_len = size_t(read_le(b, p + 32, 2));
        uint64_t local = read_le(b, p + 42, 4);
        if (cd_end - p - 46 < name_len + extra_len + comment_len) fail("corrupt zip directory");
        const std::string member(reinterpret_cast<const char*>(b.data() + p + 46), name_len);
        // zip64: the fields that are 0xFFFFFFFF come, in this order, in extra field 0x0001.
        for (size_t e = p + 46 + name_len; e + 4 <= p + 46 + name_len + extra_len;) {
            const uint64_t id = read_le(b, e, 2), len = read_le(b, e + 2, 2);
            if (e + 4 + len > p + 46 + name_len + extra_len) fail("corrupt zip extra field");
            if (id == 0x0001) {
                size_t q = e + 4;
                for (uint64_t* field : {&usize, &csize, &local}) {
                    if (*field != 0xFFFFFFFFu) continue;
                    if (q + 8 > e + 4 + len) fail("corrupt zip64 field");
                    *field = read_le(b, q, 8);
                    q += 8;
                }
            }
            e += 4 + len;
        }
        p += 46 + name_len + extra_len + comment_len;
        const std::string what = where + ": member " + member;
        if (method != 0) {
            fail("member " + member +
                 " is compressed; write traces with numpy.savez, not savez_compressed");
        }
        if ((flags & 1) != 0) fail("member " + member + " is encrypted");
        if (csize != usize) fail("member " + member + ": stored sizes disagree");
        if (local > b.size() || b.size() - local < 30 || read_le(b, size_t(local), 4) != 0x04034b50)
            fail("member " + member + ": local header outside the file");
        const uint64_t data_at =
            local + 30 + read_le(b, size_t(local) + 26, 2) + read_le(b, size_t(local) + 28, 2);
        if (data_at > b.size() || usize > b.size() - data_at) {
            fail("member " + member + " runs past the end of the file (truncated?)");
        }
        auto data = b.subspan(size_t(data_at), size_t(usize));
        if (crc32(data) != crc) fail("member " + member + " is corrupt (CRC mismatch)");
        if (!a.members_.emplace(member, data).second) fail("member " + member + " appears twice");
    }
    return a;
}

std::span<const std::byte> NpzArchive::member(const std::string& m) const {
    auto it = members_.find(m);
    if (it == members_.end()) throw TraceError("trace " + path_ + ": missing member " + m);
    return it->second;
}

void NpzWriter::add(const std::string& member, std::vector<std::byte> bytes) {
    members_.emplace_back(member, std::move(bytes));
}

std::vector<std::byte> NpzWriter::to_bytes() const {
    std::vector<std::byte> out, central;
    uint64_t offset = 0;
    auto entry_fields = [](std::vector<std::byte>& out, uint32_t crc, uint64_t size,
                           const std::string& name) {
        put_le(out, 20, 2);    // version needed: 2.0
        put_le(out, 0, 2);     // flags
        put_le(out, 0, 2);     // method: stored
        put_le(out, 0, 2);     // time
        put_le(out, 0x21, 2);  // date: 1980-01-01
        put_le(out, crc, 4);
        put_le(out, size, 4);
        put_le(out, size, 4);
        put_le(out, name.size(), 2);
        put_le(out, 0, 2);  // extra length
    };
    for (const auto& [name, data] : members_) {
        if (data.size() >= 0xFFFFFFFFu || offset >= 0xFFFFFFFFu) {
            throw std::runtime_error("npz member " + name +
                                     " would pass 4 GiB (record a shorter trace)");
        }
        const uint32_t crc = crc32(data);
        std::vector<std::byte> local;
        put_le(local, 0x04034b50, 4);
        entry_fields(local, crc, data.size(), name);
        for (char c : name) local.push_back(std::byte(c));
        out.insert(out.end(), local.begin(), local.end());
        out.insert(out.end(), data.begin(), data.end());

        put_le(central, 0x02014b50, 4);
        put_le(central, 20, 2);  // version made by
        entry_fields(central, crc, data.size(), name);
        put_le(central, 0, 2);  // comment length
        put_le(central, 0, 2);  // disk
        put_le(central, 0, 2);  // internal attributes
        put_le(central, 0, 4);  // external attributes
        put_le(central, offset, 4);
        for (char c : name) central.push_back(std::byte(c));
        offset += local.size() + data.size();
    }
    if (offset >= 0xFFFFFFFFu) throw std::runtime_error("npz archive would pass 4 GiB");
    std::vector<std::byte> end;
    put_le(end, 0x06054b50, 4);
    put_le(end, 0, 4);
    put_le(end, members_.size(), 2);
    put_le(end, members_.size(), 2);
    put_le(end, central.size(), 4);
    put_le(end, offset, 4);
    put_le(end, 0, 2);
    out.insert(out.end(), central.begin(), central.end());
    out.insert(out.end(), end.begin(), end.end());
    return out;
}

void NpzWriter::write(const std::string& path) const {
    const std::vector<std::byte> bytes = to_bytes();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    f.close();
    if (!f) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
}

}  // namespace minids::routing
