#include "cli/routing_flags.h"

#include <cstdio>

namespace minids::cli {

void add_routing_flags(CLI::App& cmd, RoutingFlags& f) {
    cmd.add_option("--record-routing", f.record,
                   "write the experts and weights every token was routed to, per MoE layer, as "
                   "a routing trace (.npz; see minids routing --help and the README)");
    cmd.add_option("--replay-routing", f.replay,
                   "route every token by this trace instead of the routers (which still run), "
                   "cycling when the trace is shorter than the run; its shape must match the "
                   "model's");
}

RoutingHooks::RoutingHooks(const RoutingFlags& flags, const LoadedModel& m, const char* command)
    : flags_(flags), command_(command) {
    const ModelConfig& c = m.model->config();
    routing::TraceShape shape;
    shape.n_experts = int32_t(c.n_routed_experts);
    shape.top_k = int32_t(c.num_experts_per_tok);
    shape.expert_bytes = m.file->experts().blob_nbytes;
    for (int64_t l : m.model->moe_layers()) shape.moe_layers.push_back(int32_t(l));
    recorded_.shape = shape;
    recorded_.source = "minids " + command_;
    recorded_.extra["model"] = m.file->path();
    if (flags_.replay.empty()) return;
    try {
        replayed_ = routing::read_trace(flags_.replay);
    } catch (const routing::TraceError& e) {
        throw UserError(std::string("--replay-routing: ") + e.what());
    }
    const routing::TraceShape& t = replayed_.shape;
    if (t.n_experts != shape.n_experts || t.top_k != shape.top_k ||
        t.n_moe_layers() != shape.n_moe_layers()) {
        throw UserError("--replay-routing: the trace " + flags_.replay + " has " +
                        std::to_string(t.n_moe_layers()) + " MoE layers of " +
                        std::to_string(t.n_experts) + " experts, top-" + std::to_string(t.top_k) +
                        "; the model has " + std::to_string(shape.n_moe_layers()) + " of " +
                        std::to_string(shape.n_experts) + ", top-" + std::to_string(shape.top_k));
    }
}

RoutingHooks::~RoutingHooks() {
    try {
        write();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "minids %s: error: %s\n", command_.c_str(), e.what());
    }
}

void RoutingHooks::install(Session& session) {
    if (!flags_.record.empty()) {
        session.set_routing_observer([this](const RoutingRecord& r) {
            recorded_.append_step(r.n_tokens, r.prefill, r.ids.data(), r.weights.data());
        });
    }
    if (!flags_.replay.empty()) {
        session.set_routing_override([this](RoutingRecord& r) {
            const int64_t L = replayed_.shape.n_moe_layers(), k = replayed_.shape.top_k;
            for (int64_t t = 0; t < r.n_tokens; ++t) {
                const int64_t src = (replay_cursor_ + t) % replayed_.n_tokens;
                for (int64_t l = 0; l < L; ++l) {
                    const int64_t at = (l * r.n_tokens + t) * k;
                    for (int64_t j = 0; j < k; ++j) {
                        r.ids[size_t(at + j)] = replayed_.ids_at(src, int32_t(l))[j];
                        r.weights[size_t(at + j)] = replayed_.weights_at(src, int32_t(l))[j];
                    }
                }
            }
            replay_cursor_ = (replay_cursor_ + r.n_tokens) % replayed_.n_tokens;
        });
    }
}

void RoutingHooks::write() {
    if (flags_.record.empty() || written_) return;
    written_ = true;
    if (recorded_.n_tokens == 0) {
        std::fprintf(stderr, "minids %s: nothing was evaluated, no routing trace written\n",
                     command_.c_str());
        return;
    }
    routing::write_trace(recorded_, flags_.record);
    std::fprintf(stderr, "minids %s: wrote the routing of %lld tokens to %s\n", command_.c_str(),
                 (long long)recorded_.n_tokens, flags_.record.c_str());
}

}  // namespace minids::cli
