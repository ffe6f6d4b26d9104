#include "step_profile.h"

#include <algorithm>
#include <cctype>
#include <cstdio>

#include "cuda_resources.h"

namespace mgl::cuda {

namespace {

// "blk.12.ffn_norm" -> "blk.#.ffn_norm": one row per kind of launch, not per layer.
std::string fold_digits(const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size(); ++i) {
        if (std::isdigit(static_cast<unsigned char>(s[i]))) {
            while (i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) ++i;
            out += '#';
        } else {
            out += s[i];
        }
    }
    return out;
}

}  // namespace

step_profile::~step_profile() {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
}

void step_profile::set_labels(std::vector<std::string> labels) {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);
    events_.clear();
    labels_ = std::move(labels);
    ms_.assign(labels_.size(), 0.0);
    replays_ = 0;
    events_.resize(labels_.size() + 1, nullptr);
    for (cudaEvent_t& e : events_) CUDA_CHECK(cudaEventCreate(&e));
}

void step_profile::mark(size_t i, cudaStream_t s, bool capturing) {
    // External: recorded as an event node of the captured graph (a plain record during capture
    // only orders streams).
    CUDA_CHECK(cudaEventRecordWithFlags(
        events_.at(i), s, capturing ? cudaEventRecordExternal : cudaEventRecordDefault));
}

void step_profile::collect(cudaStream_t s) {
    if (events_.empty()) return;
    CUDA_CHECK(cudaStreamSynchronize(s));
    for (size_t i = 0; i < labels_.size(); ++i) {
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]));
        ms_[i] += ms;
    }
    ++replays_;
}

void step_profile::merge_into(profile_table& into) const {
    if (replays_ == 0) return;
    std::map<std::string, std::pair<double, int>> mine;
    for (size_t i = 0; i < labels_.size(); ++i) {
        auto& r = mine[fold_digits(labels_[i])];
        r.first += ms_[i];
        r.second += 1;
    }
    for (const auto& [label, r] : mine) {
        auto& t = into.rows[label];
        t.first += r.first;
        t.second = std::max(t.second, r.second);
    }
    into.runs += replays_;
}

std::string profile_table::format(const std::string& title) const {
    if (runs == 0) return {};
    double total = 0;
    int launches = 0;
    for (const auto& [label, r] : rows) {
        total += r.first * 1000.0 / double(runs);
        launches += r.second;
    }
    std::vector<std::pair<std::string, std::pair<double, int>>> sorted(rows.begin(), rows.end());
    std::sort(sorted.begin(), sorted.end(),
              [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
    std::string out;
    char line[320];
    std::snprintf(line, sizeof line,
                  "cuda profile: %s: %d launches, %.1f us per run over %llu runs (each launch "
                  "also pays one timing event)\n",
                  title.c_str(), launches, total, (unsigned long long)runs);
    out += line;
    out += "  us/run   share  launches  us/launch  launch\n";
    for (const auto& [label, r] : sorted) {
        const double us = r.first * 1000.0 / double(runs);
        std::snprintf(line, sizeof line, "  %7.1f  %5.1f%%  %8d  %9.2f  %s\n", us,
                      100.0 * us / total, r.second, us / r.second, label.c_str());
        out += line;
    }
    return out;
}

replay_timer::~replay_timer() {
    if (start_) (void)cudaEventDestroy(start_);
    if (end_) (void)cudaEventDestroy(end_);
}

void replay_timer::collect() {
    if (pending_.empty()) return;
    CUDA_CHECK(cudaEventSynchronize(end_));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start_, end_));
    us_[pending_].push_back(ms * 1000.0f);
    pending_.clear();
}

void replay_timer::before(cudaStream_t s, const std::string& title) {
    if (!start_) {
        CUDA_CHECK(cudaEventCreate(&start_));
        CUDA_CHECK(cudaEventCreate(&end_));
    }
    collect();
    CUDA_CHECK(cudaEventRecord(start_, s));
    pending_ = title.empty() ? "graph" : title;
}

void replay_timer::after(cudaStream_t s) { CUDA_CHECK(cudaEventRecord(end_, s)); }

std::string replay_timer::format() {
    collect();
    std::string out;
    char line[320];
    for (auto& [title, v] : us_) {
        if (v.empty()) continue;
        std::vector<float> sorted = v;
        std::sort(sorted.begin(), sorted.end());
        double sum = 0;
        for (float x : v) sum += x;
        std::snprintf(line, sizeof line,
                      "cuda replay timer: %s: %zu replays, GPU time per replay median %.1f us, "
                      "mean %.1f us\n",
                      title.c_str(), v.size(), double(sorted[sorted.size() / 2]),
                      sum / double(v.size()));
        out += line;
    }
    return out;
}

}  // namespace mgl::cuda
