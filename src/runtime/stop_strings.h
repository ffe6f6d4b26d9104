// Streaming text through a set of stop strings: text is released as soon as it can no longer be
// the start of a stop string, and everything from the first complete stop string on is dropped.
// Used by chat, where the model may start the next turn ("User:") instead of ending with EOS.
#pragma once

#include <string>
#include <vector>

namespace minids {

class StopStringFilter {
public:
    explicit StopStringFilter(std::vector<std::string> stops);

    // Adds text; returns what is safe to print now. After a stop string was seen, returns ""
    // and stopped() is true.
    std::string push(const std::string& text);
    // Releases held-back text at the end of generation (no stop string came).
    std::string flush();
    bool stopped() const { return stopped_; }
    // Everything released so far (the answer without the stop string).
    const std::string& released() const { return released_; }

private:
    std::vector<std::string> stops_;
    std::string pending_;
    std::string released_;
    bool stopped_ = false;
};

}  // namespace minids
