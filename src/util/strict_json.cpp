#include "util/strict_json.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <unordered_set>
#include <vector>

namespace minids {

using nlohmann::json;

nlohmann::json parse_json_strict(std::string_view text, int max_depth) {
    // One set of seen keys per open object; an array opens no set but its objects do.
    std::vector<std::unordered_set<std::string>> open_objects;
    std::string duplicate;
    int too_deep = 0;
    auto on_event = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
        // Only the first problem counts: once a value is discarded the parser's events no longer
        // balance, and a later "duplicate" can be an artefact of that.
        if (!duplicate.empty() || too_deep) return false;
        if (depth > max_depth) too_deep = depth;
        switch (event) {
            case json::parse_event_t::object_start:
                open_objects.emplace_back();
                break;
            case json::parse_event_t::object_end:
                if (!open_objects.empty()) open_objects.pop_back();
                break;
            case json::parse_event_t::key: {
                const std::string& key = parsed.get_ref<const std::string&>();
                if (!open_objects.empty() && !open_objects.back().insert(key).second &&
                    duplicate.empty())
                    duplicate = key;
                break;
            }
            default:
                break;
        }
        // Returning false discards the value (so nothing deep is built); the checks below turn
        // that into an error, but the parser still has to finish (nlohmann has no early abort
        // short of throwing).
        return duplicate.empty() && too_deep == 0;
    };
    json result;
    try {
        result = json::parse(text.begin(), text.end(), on_event, /*allow_exceptions=*/true);
    } catch (const json::exception& e) {
        // e.what() carries nlohmann's position information ("at line 3, column 7").
        // Keep the message printable: nlohmann quotes the offending input bytes verbatim.
        std::string what = std::string(e.what()).substr(0, 200);
        for (char& ch : what)
            if (static_cast<unsigned char>(ch) < 0x20 || static_cast<unsigned char>(ch) >= 0x7f)
                ch = '?';
        throw JsonSyntaxError("valid JSON", what);
    }
    if (!duplicate.empty())
        throw JsonSyntaxError("unique keys in every object",
                              "the key \"" + duplicate.substr(0, 64) + "\" twice");
    if (too_deep)
        throw JsonSyntaxError("nesting at most " + std::to_string(max_depth) + " levels deep",
                              "nesting " + std::to_string(too_deep) + " levels deep");
    if (result.is_discarded()) throw JsonSyntaxError("a JSON value", "nothing");
    return result;
}

std::string read_file_bytes(const std::filesystem::path& path, uint64_t max_bytes) {
    auto fail = [&](const std::string& what) { throw FileReadError(path.string() + ": " + what); };
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(std::string("cannot open: ") + std::strerror(errno));
    struct Close {
        int fd;
        ~Close() { ::close(fd); }
    } close_at_exit{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) fail(std::string("cannot stat: ") + std::strerror(errno));
    if (S_ISDIR(st.st_mode)) fail("expected a file, found a directory");
    if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode) && !S_ISCHR(st.st_mode))
        fail("expected a file, found something else (a socket or device)");
    if (S_ISREG(st.st_mode) && uint64_t(st.st_size) > max_bytes)
        fail("expected at most " + std::to_string(max_bytes) + " bytes, found " +
             std::to_string(st.st_size));
    std::string bytes;
    char buf[1 << 16];
    for (;;) {
        const ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR) continue;
            fail(std::string("cannot read: ") + std::strerror(errno));
        }
        if (n == 0) break;
        if (bytes.size() + size_t(n) > max_bytes)
            fail("expected at most " + std::to_string(max_bytes) + " bytes, found more");
        bytes.append(buf, size_t(n));
    }
    return bytes;
}

nlohmann::json read_json_file_strict(const std::filesystem::path& path, uint64_t max_bytes) {
    const std::string text = read_file_bytes(path, max_bytes);
    try {
        return parse_json_strict(text);
    } catch (const JsonSyntaxError& e) {
        throw FileReadError(path.string() + ": " + e.what());
    }
}

}  // namespace minids
