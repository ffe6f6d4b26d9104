#include "util/output_file.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <mutex>

namespace minids {

namespace fs = std::filesystem;

namespace {

// The paths a signal handler must remove. A handler can reach nothing but static storage, so this
// is the one process-wide list of temporary outputs; a slot's path is written before the slot is
// published (release) and read by the handler only when published (acquire, lock-free).
constexpr int kSlots = 16;
constexpr size_t kMaxPath = 4096;
char g_paths[kSlots][kMaxPath];
std::atomic<int> g_published[kSlots];
std::mutex g_slots_mutex;  // between threads registering; handlers never take it

void write_stderr(const char* s) {
    ssize_t ignored = ::write(STDERR_FILENO, s, std::strlen(s));
    (void)ignored;
}

extern "C" void on_terminating_signal(int sig) {
    remove_registered_temp_files();
    switch (sig) {
        case SIGINT:
            write_stderr("\nminids: interrupted\n");
            break;
        case SIGXCPU:
            write_stderr("\nminids: stopped: CPU time limit reached (ulimit -t)\n");
            break;
        default:
            write_stderr(sig == SIGTERM  ? "\nminids: stopped by SIGTERM\n"
                         : sig == SIGHUP ? "\nminids: stopped by SIGHUP\n"
                                         : "\nminids: stopped by SIGQUIT\n");
    }
    _exit(128 + sig);
}

extern "C" void on_crash_signal(int sig) {
    remove_registered_temp_files();
    write_stderr(sig == SIGABRT ? "minids: internal error: aborted\n"
                                : "minids: internal error: crashed (a bug; please report it)\n");
    _exit(70);
}

void on_terminate() {
    remove_registered_temp_files();
    write_stderr("minids: internal error: terminated by an unhandled exception\n");
    _exit(70);
}

// Installs `handler` for `sig` unless the signal is ignored (nohup, a background job): an
// ignored signal stays ignored.
void install(int sig, void (*handler)(int), int flags) {
    struct sigaction old {};
    if (sigaction(sig, nullptr, &old) != 0 || old.sa_handler == SIG_IGN) return;
    struct sigaction sa {};
    sa.sa_handler = handler;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = flags;
    sigaction(sig, &sa, nullptr);
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;  // the sanitizers report crashes themselves
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

[[noreturn]] void fail(const fs::path& path, const std::string& what) {
    throw OutputError(path.string() + ": " + what);
}

}  // namespace

void remove_registered_temp_files() {
    for (int i = 0; i < kSlots; ++i)
        if (g_published[i].load(std::memory_order_acquire)) ::unlink(g_paths[i]);
}

void install_output_cleanup_handlers() {
    // Writes past ulimit -f fail with EFBIG instead of killing the process; writes to a closed
    // pipe fail with EPIPE, which the commands report.
    signal(SIGXFSZ, SIG_IGN);
    signal(SIGPIPE, SIG_IGN);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGXCPU})
        install(sig, on_terminating_signal, 0);
    std::set_terminate(on_terminate);
    if (kSanitized) return;
    // A stack overflow can only be handled on a stack of its own.
    static char alt_stack[1 << 16];
    stack_t ss{};
    ss.ss_sp = alt_stack;
    ss.ss_size = sizeof alt_stack;
    sigaltstack(&ss, nullptr);
    for (int sig : {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT})
        install(sig, on_crash_signal, SA_ONSTACK | SA_RESETHAND);
}

TempFileRegistration::TempFileRegistration(const fs::path& path) {
    const std::string& s = path.native();
    if (s.size() >= kMaxPath) fail(path, "path too long");
    std::lock_guard lock(g_slots_mutex);
    for (int i = 0; i < kSlots; ++i) {
        if (g_published[i].load(std::memory_order_relaxed)) continue;
        std::memcpy(g_paths[i], s.c_str(), s.size() + 1);
        g_published[i].store(1, std::memory_order_release);
        slot_ = i;
        return;
    }
    fail(path, "too many output files open at once");
}

TempFileRegistration::~TempFileRegistration() {
    std::lock_guard lock(g_slots_mutex);
    g_published[slot_].store(0, std::memory_order_release);
}

fs::path temp_path_for(const fs::path& path) { return fs::path(path.string() + ".tmp"); }

void check_output_file(const fs::path& path, bool overwrite) {
    std::error_code ec;
    if (path.empty()) throw OutputError("expected an output file name, found an empty one");
    if (fs::is_directory(path, ec)) fail(path, "expected a file to write, found a directory");
    if (!overwrite && fs::exists(path, ec))
        fail(path, "the output file already exists (use --force to overwrite it)");
    const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
    if (!fs::is_directory(dir, ec))
        fail(path, "expected an existing directory to write into, found that " + dir.string() +
                       " does not exist");
    // Whether a file can really be created there (permissions, read-only file systems).
    const fs::path probe = temp_path_for(path);
    const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail(path, std::string("cannot create a file there: ") + std::strerror(errno));
    ::close(fd);
    ::unlink(probe.c_str());
}

void write_file_atomically(const fs::path& path, std::span<const std::string_view> pieces) {
    const fs::path tmp = temp_path_for(path);
    TempFileRegistration registration(tmp);
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail(path, std::string("cannot create: ") + std::strerror(errno));
    auto give_up = [&](const char* what) {
        const int err = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        fail(path, std::string(what) + ": " + std::strerror(err));
    };
    for (std::string_view piece : pieces) {
        while (!piece.empty()) {
            const ssize_t n = ::write(fd, piece.data(), piece.size());
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                if (n == 0) errno = ENOSPC;
                give_up("cannot write");
            }
            piece.remove_prefix(size_t(n));
        }
    }
    if (::close(fd) != 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        fail(path, std::string("cannot write: ") + std::strerror(err));
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        const int err = errno;
        ::unlink(tmp.c_str());
        fail(path,
             std::string("cannot rename the finished file into place: ") + std::strerror(err));
    }
}

}  // namespace minids
