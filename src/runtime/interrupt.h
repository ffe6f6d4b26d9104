// Ctrl-C for the generation loop and the chat REPL.
//
// While an InterruptHandler is alive, SIGINT does not kill the process: the first one sets a flag
// that the generation loop polls (it stops the answer being generated); a second one before the
// flag is cleared, or one that arrives while the program waits at a prompt (set_at_prompt), exits
// at once with status 130. The previous handler comes back when the object is destroyed.
#pragma once

#include <csignal>

namespace minids {

class InterruptHandler {
public:
    InterruptHandler();
    ~InterruptHandler();
    InterruptHandler(const InterruptHandler&) = delete;
    InterruptHandler& operator=(const InterruptHandler&) = delete;

    // True once Ctrl-C was pressed since the last clear().
    bool requested() const;
    void clear();
    // While waiting for input a single Ctrl-C exits (status 130).
    void set_at_prompt(bool at_prompt);

private:
    struct sigaction previous_ {};
};

}  // namespace minids
