// A NumPy .npz archive (an uncompressed zip of .npy arrays), read and written without zlib, so
// routing traces are one file that `numpy.load` opens. The reader trusts nothing in the file:
// every offset, size, CRC and .npy header is checked, and anything wrong is one TraceError
// sentence naming the file and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace minids::routing {

// A malformed, truncated or inconsistent trace file (a user error: exit code 2).
struct TraceError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

uint32_t crc32(std::span<const std::byte> data, uint32_t crc = 0);

// One array of a .npy member: its dtype string ('<i4', '|u1', '<f4', '|b1', ...), shape and
// the raw little-endian C-order bytes.
struct NpyView {
    std::string descr;
    std::vector<int64_t> shape;
    std::span<const std::byte> data;
    int64_t n_elements() const;
};

// Parses a .npy (format 1.0, 2.0 or 3.0): C order only, data size exactly shape × itemsize.
// `what` names the member in error messages.
NpyView parse_npy(std::span<const std::byte> bytes, const std::string& what);
// A .npy file image of `data` with the given dtype and shape (format 1.0, header padded to 64).
std::vector<std::byte> make_npy(const std::string& descr, const std::vector<int64_t>& shape,
                                std::span<const std::byte> data);

// Members of an archive read whole into memory. Stored (uncompressed) members only; zip64
// sizes and offsets (as numpy.savez writes them) are understood.
class NpzArchive {
public:
    static NpzArchive read(const std::string& path);
    static NpzArchive from_bytes(std::vector<std::byte> bytes, const std::string& name);
    bool has(const std::string& member) const { return members_.count(member) != 0; }
    // Throws TraceError when the member is absent.
    std::span<const std::byte> member(const std::string& member) const;
    const std::string& path() const { return path_; }

private:
    std::string path_;
    std::vector<std::byte> bytes_;
    std::map<std::string, std::span<const std::byte>> members_;
};

// Collects members and writes the archive. Throws std::runtime_error when the file cannot be
// written or a member passes 4 GiB (no zip64 on the writing side).
class NpzWriter {
public:
    void add(const std::string& member, std::vector<std::byte> bytes);
    std::vector<std::byte> to_bytes() const;
    void write(const std::string& path) const;

private:
    std::vector<std::pair<std::string, std::vector<std::byte>>> members_;
};

}  // namespace minids::routing
