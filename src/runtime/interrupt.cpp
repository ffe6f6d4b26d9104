#include "runtime/interrupt.h"

#include <unistd.h>

#include "util/output_file.h"

namespace minids {

namespace {

// A signal handler can only talk to the program through objects of static storage of type
// volatile sig_atomic_t (C++ [support.signal]); these two are the only such state in minids and
// are owned by the one live InterruptHandler.
volatile std::sig_atomic_t g_interrupt_pending = 0;
volatile std::sig_atomic_t g_at_prompt = 0;

void on_sigint(int) {
    if (g_at_prompt || g_interrupt_pending) {
        // Only async-signal-safe calls here: write(2) and _exit(2).
        const char nl = '\n';
        ssize_t ignored = write(STDERR_FILENO, &nl, 1);
        (void)ignored;
        remove_registered_temp_files();
        _exit(130);
    }
    g_interrupt_pending = 1;
}

}  // namespace

InterruptHandler::InterruptHandler() {
    g_interrupt_pending = 0;
    g_at_prompt = 0;
    struct sigaction sa {};
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, &previous_);
}

InterruptHandler::~InterruptHandler() { sigaction(SIGINT, &previous_, nullptr); }

bool InterruptHandler::requested() const { return g_interrupt_pending != 0; }
void InterruptHandler::clear() { g_interrupt_pending = 0; }
void InterruptHandler::set_at_prompt(bool at_prompt) { g_at_prompt = at_prompt ? 1 : 0; }

}  // namespace minids
