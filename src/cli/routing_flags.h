// --record-routing FILE and --replay-routing FILE on run and chat: the routing of every eval
// written as a routing trace (routing/trace.h), or a trace's routing imposed on the engine in
// place of the routers' choice (through Session's routing observer and override).
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/model_session.h"
#include "routing/trace.h"
#include "runtime/session.h"

namespace minids::cli {

struct RoutingFlags {
    std::string record;  // --record-routing
    std::string replay;  // --replay-routing
};

void add_routing_flags(CLI::App& cmd, RoutingFlags& flags);

// Installs the observer / override on a session. The replayed trace is read and checked against
// the model when constructed (UserError when it does not fit). The recorded trace is written by
// write() (or, failing that, when the object is destroyed, e.g. on an early return).
class RoutingHooks {
public:
    RoutingHooks(const RoutingFlags& flags, const LoadedModel& m, const char* command);
    ~RoutingHooks();
    RoutingHooks(const RoutingHooks&) = delete;
    RoutingHooks& operator=(const RoutingHooks&) = delete;
    void install(Session& session);
    // Writes the recorded trace (when --record-routing was given and anything was evaluated).
    void write();

private:
    RoutingFlags flags_;
    std::string command_;
    routing::RoutingTrace recorded_, replayed_;
    int64_t replay_cursor_ = 0;
    bool written_ = false;
};

}  // namespace minids::cli
