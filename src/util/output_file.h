// Output files that are never left half-written: each is written as PATH.tmp and renamed into
// place once complete. The temporary file is removed on every failure path: by its owner's
// destructor when an exception unwinds, and by the signal handlers of
// install_output_cleanup_handlers() when the process is stopped by a signal (Ctrl-C, SIGTERM,
// SIGHUP, ulimit -t's SIGXCPU), aborts or crashes. SIGXFSZ (ulimit -f) is ignored, so a write
// past the limit fails with EFBIG and is reported like a full disk.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>

namespace minids {

// An output that cannot be created or written: "PATH: reason". A user error (exit 2) when
// check_output_file throws it, an I/O failure (exit 1) when a write does.
struct OutputError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Called once by main(): the handlers that remove registered temporary files when a signal ends
// the process (exit status 128 + the signal; 70 after a crash or abort, with one line on stderr).
void install_output_cleanup_handlers();
// Removes every registered temporary file now; async-signal-safe.
void remove_registered_temp_files();

// While alive, `path` is removed if a signal ends the process. At most 16 at a time.
class TempFileRegistration {
public:
    explicit TempFileRegistration(const std::filesystem::path& path);
    ~TempFileRegistration();
    TempFileRegistration(const TempFileRegistration&) = delete;
    TempFileRegistration& operator=(const TempFileRegistration&) = delete;

private:
    int slot_ = -1;
};

// PATH.tmp, the name outputs are written under before the rename.
std::filesystem::path temp_path_for(const std::filesystem::path& path);

// Checks before any work that `path` can be written: not a directory, its directory exists and
// accepts a new file (PATH.tmp is created and removed). With `overwrite` false, an existing PATH
// is refused too. Throws OutputError with the path, what was expected and what was found.
void check_output_file(const std::filesystem::path& path, bool overwrite = true);

// Writes the concatenation of `pieces` to `path` through PATH.tmp and a rename (no fsync: this
// guards against the process failing, not the machine; the .mds writer fsyncs). Throws
// OutputError (e.g. "x.npy: cannot write: No space left on device"), leaving no file behind.
void write_file_atomically(const std::filesystem::path& path,
                           std::span<const std::string_view> pieces);

}  // namespace minids
