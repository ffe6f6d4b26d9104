#include "runtime/stop_strings.h"

#include <algorithm>

namespace minids {

StopStringFilter::StopStringFilter(std::vector<std::string> stops) {
    for (auto& s : stops) {
        if (!s.empty()) stops_.push_back(std::move(s));
    }
}

std::string StopStringFilter::push(const std::string& text) {
    if (stopped_) return {};
    pending_ += text;
    size_t first_stop = std::string::npos;
    for (const auto& s : stops_) first_stop = std::min(first_stop, pending_.find(s));
    if (first_stop != std::string::npos) {
        std::string out = pending_.substr(0, first_stop);
        pending_.clear();
        stopped_ = true;
        released_ += out;
        return out;
    }
    // Hold back the longest tail of pending_ that is a proper prefix of some stop string.
    size_t hold = 0;
    for (const auto& s : stops_) {
        for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n) {
            if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
                hold = n;
                break;
            }
        }
    }
    std::string out = pending_.substr(0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
    released_ += out;
    return out;
}

std::string StopStringFilter::flush() {
    if (stopped_) return {};
    std::string out;
    out.swap(pending_);
    released_ += out;
    return out;
}

}  // namespace minids
