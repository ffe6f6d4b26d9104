// The CUDA backend: device and pinned buffers, host registration, copies on one stream,
// allocate() (memory plan, fusions, kernel parameters, workspaces) and compute() (eager, or a
// captured CUDA graph replayed for graphs marked reusable).
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <list>
#include <map>
#include <set>
#include <string>
#include <unordered_map>

#include "cuda_resources.h"
#include "elementwise.h"
#include "fusion.h"
#include "launches.h"
#include "link_trace.h"
#include "mgl-cuda.h"
#include "step_profile.h"

namespace mgl {

namespace cuda {
namespace {

bool env_flag(const char* name, bool fallback) {
    const char* v = std::getenv(name);
    if (!v || !*v) return fallback;
    return std::string(v) != "0";
}

double mib(size_t n) { return double(n) / (1024.0 * 1024.0); }

class device_buffer final : public buffer {
public:
    explicit device_buffer(size_t bytes) : mem_(bytes) {}
    void* base() override { return mem_.get(); }
    size_t size() const override { return mem_.size(); }
    memory_kind kind() const override { return memory_kind::device; }

private:
    device_memory mem_;
};

class pinned_buffer final : public buffer {
public:
    explicit pinned_buffer(size_t bytes) : mem_(bytes) {}
    void* base() override { return mem_.get(); }
    size_t size() const override { return mem_.size(); }
    memory_kind kind() const override { return memory_kind::pinned_host; }

private:
    pinned_memory mem_;
};

// Copies on a stream of their own, with one event per fence (polled, never waited on but in
// drain()).
class cuda_transfer_queue final : public transfer_queue {
public:
    cuda_transfer_queue() {
        if (env_flag("MINIDS_LINK_TRACE", false))
            trace_ = std::make_unique<link_trace>("a transfer queue's copies");
    }
    ~cuda_transfer_queue() override {
        (void)cudaStreamSynchronize(stream_.get());
        trace_.reset();  // prints, now that every copy has landed
    }
    void copy(void* dst, const void* src, size_t n) override {
        if (trace_) trace_->before(stream_.get(), src);
        CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_.get()));
        if (trace_) trace_->after(stream_.get(), n);
    }
    uint64_t fence() override {
        event e;
        e.record(stream_.get());
        pending_.emplace_back(++fences_, std::move(e));
        return fences_;
    }
    bool done(uint64_t f) override {
        while (!pending_.empty()) {
            const cudaError_t q = cudaEventQuery(pending_.front().second.get());
            if (q == cudaErrorNotReady) break;
            CUDA_CHECK(q);
            completed_ = pending_.front().first;
            pending_.pop_front();
        }
        return f <= completed_;
    }
    void drain() override {
        CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
        pending_.clear();
        completed_ = fences_;
    }

    // The driver's stream memory operation (cuStreamWriteValue64), found at run time so that the
    // binary needs no link to the driver library (a machine without a GPU still starts it).
    void signal(int64_t* word, int64_t value) override {
        using write_value_fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
        static const write_value_fn write_value = [] {
            void* fn = nullptr;
            cudaDriverEntryPointQueryResult found{};
            CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000,
                                                        cudaEnableDefault, &found));
            if (found != cudaDriverEntryPointSuccess || !fn)
                throw error("CUDA: the driver has no cuStreamWriteValue64");
            return reinterpret_cast<write_value_fn>(fn);
        }();
        const CUresult r = write_value(stream_.get(), reinterpret_cast<CUdeviceptr>(word),
                                       cuuint64_t(value), CU_STREAM_WRITE_VALUE_DEFAULT);
        if (r != CUDA_SUCCESS)
            throw error("CUDA: cuStreamWriteValue64 failed (error " + std::to_string(int(r)) + ")");
    }

private:
    cuda::stream stream_;
    std::unique_ptr<link_trace> trace_;  // MINIDS_LINK_TRACE=1
    std::deque<std::pair<uint64_t, event>> pending_;
    uint64_t fences_ = 0, completed_ = 0;
};

// What allocate() prepared for one graph, kept under the graph's version.
struct graph_plan {
    launch_list launches;
    size_t nodes = 0;
    int fused_norm = 0, fused_residual = 0, fused_route = 0, fused_mla_prep = 0;
    int fused_norm_out = 0, fused_router_route = 0, fused_route_fetch = 0;
    bool warmed_up = false;  // one eager run before capturing (lazy module loads, cuBLAS setup)
    graph_exec recording;
    uint64_t recorded_workspace_generation = 0;
    uint64_t graph_launches = 0, eager_runs = 0;
    // MINIDS_CUDA_PROFILE: time per launch of the replayed recording and of eager runs.
    std::unique_ptr<step_profile> replay_profile, eager_profile;
    std::string title;
};

// Growable device workspace: only grows; a new buffer invalidates recordings (generation).
struct workspace {
    device_memory mem;
    uint64_t generation = 0;
};

class cuda_backend final : public backend {
public:
    explicit cuda_backend(const cuda_options& o)
        : device_(o.device),
          graphs_(o.graphs && env_flag("MINIDS_CUDA_GRAPHS", true)),
          pdl_(o.pdl && env_flag("MINIDS_CUDA_PDL", true)),
          verbose_(env_flag("MINIDS_CUDA_VERBOSE", false)),
          sync_each_(env_flag("MINIDS_CUDA_SYNC", false)),
          profile_(env_flag("MINIDS_CUDA_PROFILE", false)),
          replay_timing_(env_flag("MINIDS_CUDA_REPLAY_TIMER", false)),
          fusions_(fusion_switches_from_env(o.fuse)),
          stream_((use_device(), cuda::stream())),
          cublas_(stream_.get(), size_t(32) << 20),
          error_record_(sizeof(device_error)) {
        *host_error() = device_error{};
        error_device_ = static_cast<device_error*>(error_record_.device_pointer());
    }

    ~cuda_backend() override {
        (void)cudaStreamSynchronize(stream_.get());
        for (auto& [version, plan] : plans_) merge_profile(*plan);
        for (const auto& [title, t] : profiles_) std::fputs(t.format(title).c_str(), stderr);
        if (replay_timing_) std::fputs(replay_timer_.format().c_str(), stderr);
    }

    const char* name() const override { return "cuda"; }
    bool supports_op(const tensor& node) const override {
        return cuda_unsupported_reason(node).empty();
    }
    memory_kind compute_memory() const override { return memory_kind::device; }

    buffer_ptr alloc_buffer(size_t bytes) override {
        use_device();
        return std::make_unique<device_buffer>(bytes);
    }
    buffer_ptr alloc_host_buffer(size_t bytes) override {
        use_device();
        return std::make_unique<pinned_buffer>(bytes);
    }
    std::unique_ptr<mgl::host_registration> register_host(const void* p, size_t n,
                                                          bool read_only) override {
        use_device();
        return host_registration::try_register(p, n, read_only);
    }

    void upload(tensor& t, const void* src, size_t offset, size_t n) override {
        upload_async(t, src, offset, n);
        synchronize();
    }
    void upload_async(tensor& t, const void* src, size_t offset, size_t n) override {
        check_range(t, offset, n, "upload into");
        use_device();
        CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(t.data) + offset, src, n, cudaMemcpyDefault,
                                   stream_.get()));
    }
    void download(const tensor& t, void* dst, size_t offset, size_t n) override {
        download_async(t, dst, offset, n);
        synchronize();
    }
    void download_async(const tensor& t, void* dst, size_t offset, size_t n) override {
        check_range(t, offset, n, "download from");
        use_device();
        CUDA_CHECK(cudaMemcpyAsync(dst, static_cast<const char*>(t.data) + offset, n,
                                   cudaMemcpyDefault, stream_.get()));
    }
    void copy_to_backend(void* dst, const void* src, size_t n) override {
        copy_to_backend_async(dst, src, n);
        synchronize();
    }
    void copy_to_backend_async(void* dst, const void* src, size_t n) override {
        use_device();
        CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream_.get()));
    }
    std::unique_ptr<transfer_queue> make_transfer_queue() override {
        use_device();
        return std::make_unique<cuda_transfer_queue>();
    }

    void allocate(graph& g, arena& a) override {
        use_device();
        for (const tensor* n : g.nodes) {
            const std::string why = cuda_unsupported_reason(*n);
            MGL_CHECK(why.empty(), "cuda backend cannot run " + std::string(op_name(n->op_kind)) +
                                       " node '" + n->name + "' " + shape_str(*n) + ": " + why);
        }
        clear_plan(g, a.buf.get());
        const fusion_plan fusions = plan_fusions(g, fusions_);
        const alloc_plan plan = plan_allocation(g, 256, fusions.also_reads);
        if (!a.buf || a.buf->size() < plan.arena_bytes || a.buf->kind() != memory_kind::device) {
            // Work queued earlier may still use the old arena.
            CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
            a.buf = alloc_buffer(plan.arena_bytes);
            ++a.generation;
        }
        apply_plan(g, plan, *a.buf);
        for (const tensor* leaf : g.leafs) check_device_accessible(*leaf);
        g.placed_in = &a;
        g.arena_generation = a.generation;
        g.version = new_graph_version();
        graph_plan& p = build_plan(g, fusions);
        if (verbose_) {
            std::fprintf(stderr,
                         "cuda: graph %llu: %zu nodes -> %zu launches (fused: %d norm, %d "
                         "residual, %d route (%d with the router, %d planning the fetch), %d "
                         "mla_prep); arena %.1f MiB, workspace %.1f + %.1f MiB\n",
                         (unsigned long long)g.version, p.nodes, p.launches.steps.size(),
                         p.fused_norm, p.fused_residual, p.fused_route, p.fused_router_route,
                         p.fused_route_fetch, p.fused_mla_prep, mib(a.buf->size()),
                         mib(matmul_ws_.mem.size()), mib(scratch_.mem.size()));
        }
    }

    void compute(graph& g) override {
        check_not_stale(g);
        MGL_CHECK(g.placed_in->buf && g.placed_in->buf->kind() == memory_kind::device,
                  "compute: the graph was not allocated by a CUDA backend");
        use_device();
        graph_plan& p = plan_for(g);
        const exec_env env = environment();
        if (g.reusable && graphs_ && !sync_each_) {
            const uint64_t ws_generation =
                matmul_ws_.generation + scratch_.generation + tickets_.generation;
            if (!p.recording || p.recorded_workspace_generation != ws_generation) {
                if (!p.warmed_up) {
                    run_eager(p, env);
                    p.warmed_up = true;
                    return;
                }
                capture(g, p, env);
                p.recorded_workspace_generation = ws_generation;
            }
            if (replay_timing_) replay_timer_.before(stream_.get(), p.title);
            p.recording.launch(stream_.get());
            if (replay_timing_) replay_timer_.after(stream_.get());
            ++p.graph_launches;
            if (p.replay_profile) p.replay_profile->collect(stream_.get());
            return;
        }
        run_eager(p, env);
    }

    // compute() captures and launches, or replays, a reusable graph once it has run eagerly
    // (the warm-up); the same conditions as there. Not while profiling (MINIDS_CUDA_PROFILE):
    // compute() then waits for the replay to read its timing events, so nothing the host would
    // write after the launch (an expert cache's victims) could come before the step needs it.
    bool launches_whole(const graph& g) const override {
        if (!g.reusable || !graphs_ || sync_each_ || profile_) return false;
        auto it = plans_.find(g.version);
        return it != plans_.end() && it->second->warmed_up;
    }

    void synchronize() override {
        use_device();
        CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
        check_device_error();
    }

    cuda_graph_info info(const graph& g) {
        cuda_graph_info out;
        auto it = plans_.find(g.version);
        if (it == plans_.end()) return out;
        const graph_plan& p = *it->second;
        out.known = true;
        out.nodes = p.nodes;
        out.launches = p.launches.steps.size();
        out.fused_norm = p.fused_norm;
        out.fused_residual = p.fused_residual;
        out.fused_route = p.fused_route;
        out.fused_mla_prep = p.fused_mla_prep;
        out.fused_norm_out = p.fused_norm_out;
        out.fused_router_route = p.fused_router_route;
        out.fused_route_fetch = p.fused_route_fetch;
        out.captured = bool(p.recording);
        out.graph_launches = p.graph_launches;
        out.eager_runs = p.eager_runs;
        return out;
    }

private:
    void use_device() const { CUDA_CHECK(cudaSetDevice(device_)); }
    device_error* host_error() const { return static_cast<device_error*>(error_record_.get()); }

    static void check_range(const tensor& t, size_t offset, size_t n, const char* what) {
        MGL_CHECK(t.data != nullptr, std::string(what) + " '" + t.name + "', which has no memory");
        MGL_CHECK(offset + n <= nbytes(t),
                  std::string(what) + " '" + t.name + "': " + std::to_string(n) + " bytes at " +
                      std::to_string(offset) + " pass its " + std::to_string(nbytes(t)) + " bytes");
    }

    // Leaves must be memory the kernels can read: device memory, or pinned / registered host
    // memory whose device address is its host address (unified addressing).
    void check_device_accessible(const tensor& leaf) const {
        if (leaf.buf) {
            MGL_CHECK(leaf.buf->kind() != memory_kind::host,
                      "cuda backend: leaf '" + leaf.name + "' " + shape_str(leaf) +
                          " is in a host buffer; allocate it with the CUDA backend");
            return;
        }
        cudaPointerAttributes attr{};
        const cudaError_t err = cudaPointerGetAttributes(&attr, leaf.data);
        if (err != cudaSuccess) (void)cudaGetLastError();
        const bool device = err == cudaSuccess && (attr.type == cudaMemoryTypeDevice ||
                                                   attr.type == cudaMemoryTypeManaged);
        const bool mapped_host = err == cudaSuccess && attr.type == cudaMemoryTypeHost &&
                                 attr.devicePointer == leaf.data;
        MGL_CHECK(device || mapped_host,
                  "cuda backend: leaf '" + leaf.name + "' " + shape_str(leaf) +
                      " points at memory the device cannot read (" +
                      (err == cudaSuccess && attr.type == cudaMemoryTypeHost
                           ? "registered host memory with a different device address"
                           : "unregistered host memory") +
                      "); copy it into an alloc_buffer() buffer or register it");
    }

    const float* inv_freq(const std::shared_ptr<const rope_params>& p) {
        auto it = rope_tables_.find(p.get());
        if (it != rope_tables_.end()) return static_cast<const float*>(it->second.second.get());
        device_memory mem(p->inv_freq.size() * sizeof(float));
        CUDA_CHECK(cudaMemcpyAsync(mem.get(), p->inv_freq.data(), p->inv_freq.size() * 4,
                                   cudaMemcpyHostToDevice, stream_.get()));
        CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
        auto& slot = rope_tables_[p.get()];
        slot = {p, std::move(mem)};  // keeps the table alive: the key is its address
        return static_cast<const float*>(slot.second.get());
    }

    // Only grows; the matmul part is zeroed when (re)allocated (split-K counters).
    void reserve(workspace& w, size_t bytes, bool zero) {
        if (w.mem.get() && w.mem.size() >= bytes) return;
        CUDA_CHECK(cudaStreamSynchronize(stream_.get()));  // queued work may use the old one
        const size_t rounded = std::max<size_t>((bytes + (1 << 20) - 1) >> 20 << 20, 1 << 20);
        w.mem = device_memory();
        w.mem = device_memory(rounded);
        // On the backend's stream: it does not synchronize with the legacy default stream.
        if (zero) CUDA_CHECK(cudaMemsetAsync(w.mem.get(), 0, rounded, stream_.get()));
        ++w.generation;
    }

    graph_plan& build_plan(const graph& g, const fusion_plan& fusions) {
        auto p = std::make_unique<graph_plan>();
        launch_context ctx;
        ctx.inv_freq = [this](const std::shared_ptr<const rope_params>& r) { return inv_freq(r); };
        p->launches = build_launches(g, fusions, ctx);
        p->nodes = g.nodes.size();
        p->fused_norm = fusions.n_norm + fusions.n_norm_out;
        p->fused_norm_out = fusions.n_norm_out;
        p->fused_residual = fusions.n_residual;
        p->fused_route = fusions.n_route;
        p->fused_mla_prep = fusions.n_mla_prep;
        p->fused_router_route = fusions.n_router_route;
        p->fused_route_fetch = fusions.n_route_fetch;
        p->title =
            std::to_string(g.nodes.size()) + "-node graph" + (g.reusable ? " (reusable)" : "");
        // The side stream's regions follow the main ones (launch_list).
        reserve(matmul_ws_,
                p->launches.matmul_workspace_bytes + p->launches.side_matmul_workspace_bytes, true);
        reserve(
            scratch_,
            p->launches.scratch_bytes + p->launches.side_scratch_bytes + p->launches.moe_act_bytes,
            false);
        // Zeroed when allocated; each router_route launch leaves its counter at 0.
        if (p->launches.tickets)
            reserve(tickets_, p->launches.tickets * sizeof(unsigned int), true);
        // Keep the plans of the graphs used last; an evicted one is rebuilt if computed again.
        constexpr size_t max_plans = 32;
        while (plans_.size() >= max_plans) {
            auto oldest =
                std::min_element(last_use_.begin(), last_use_.end(),
                                 [](const auto& a, const auto& b) { return a.second < b.second; });
            merge_profile(*plans_[oldest->first]);
            plans_.erase(oldest->first);
            last_use_.erase(oldest);
        }
        graph_plan& ref = *p;
        plans_[g.version] = std::move(p);
        last_use_[g.version] = ++clock_;
        return ref;
    }

    graph_plan& plan_for(const graph& g) {
        auto it = plans_.find(g.version);
        if (it == plans_.end()) return build_plan(g, plan_fusions(g, fusions_));
        last_use_[g.version] = ++clock_;
        return *it->second;
    }

    exec_env environment() const {
        exec_env e;
        e.stream = stream_.get();
        e.cublas = cublas_.get();
        e.matmul_workspace = matmul_ws_.mem.get();
        e.matmul_workspace_bytes = matmul_ws_.mem.size();
        e.scratch = scratch_.mem.get();
        e.scratch_bytes = scratch_.mem.size();
        e.tickets = static_cast<unsigned int*>(tickets_.mem.get());
        e.error = error_device_;
        e.pdl = pdl_;
        return e;
    }

    // The side stream's environment for the plan's steps: its own stream and regions, no PDL
    // (its first kernel depends on an event, not on the kernel before it in its stream).
    exec_env side_environment(const graph_plan& p, const exec_env& main) const {
        exec_env e = main;
        e.stream = side_stream_.get();
        e.pdl = false;
        e.matmul_workspace =
            static_cast<char*>(main.matmul_workspace) + p.launches.matmul_workspace_bytes;
        e.matmul_workspace_bytes = p.launches.side_matmul_workspace_bytes;
        e.scratch = static_cast<char*>(main.scratch) + p.launches.scratch_bytes;
        e.scratch_bytes = p.launches.side_scratch_bytes;
        return e;
    }

    // The plan's shared_beside region, after the main and side scratch (launch_list).
    static exec_env with_moe_act(const graph_plan& p, exec_env e) {
        e.moe_act = static_cast<char*>(e.scratch) + p.launches.scratch_bytes +
                    p.launches.side_scratch_bytes;
        e.moe_act_bytes = p.launches.moe_act_bytes;
        return e;
    }

    // Forks the side stream from the main one before a side step that follows main work, and
    // joins it before a main step marked join (and at the end), with events: the same calls
    // build the fork and join edges when the steps are being captured.
    class lanes {
    public:
        lanes(cuda_backend& b, const graph_plan& p, const exec_env& main)
            : b_(b),
              main_(with_moe_act(p, main)),
              side_(p.launches.has_side ? b.side_environment(p, main_) : main_) {}
        // The environment step s runs with, after any fork or join it needs.
        const exec_env& before(const launch_step& s) {
            if (s.side) {
                if (main_since_fork_) {
                    b_.fork_.record(main_.stream);
                    CUDA_CHECK(cudaStreamWaitEvent(side_.stream, b_.fork_.get(), 0));
                    main_since_fork_ = false;
                }
                side_pending_ = true;
                return side_;
            }
            main_since_fork_ = true;
            if (s.join && side_pending_) {
                join();
                joined_ = main_;
                // It depends on the side stream too: without PDL, unless the step reads nothing
                // before its wait (launch_step::join_keeps_pdl).
                joined_.pdl = s.join_keeps_pdl && main_.pdl;
                return joined_;
            }
            return main_;
        }
        void finish() {
            if (side_pending_) join();
        }

    private:
        void join() {
            b_.join_.record(side_.stream);
            CUDA_CHECK(cudaStreamWaitEvent(main_.stream, b_.join_.get(), 0));
            side_pending_ = false;
        }
        cuda_backend& b_;
        exec_env main_, side_, joined_;
        bool main_since_fork_ = true, side_pending_ = false;
    };

    static void run_step(const launch_step& s, const exec_env& env) {
        try {
            if (s.after_fetch) {
                exec_env e = env;
                e.after_fetch = true;
                s.run(e);
            } else {
                s.run(env);
            }
        } catch (const std::exception& e) {
            throw error(std::string(e.what()) + " [cuda " + s.what + " for '" +
                        (s.node ? s.node->name : std::string()) + "']");
        }
    }

    static std::vector<std::string> step_labels(const graph_plan& p) {
        std::vector<std::string> labels;
        for (const launch_step& s : p.launches.steps) {
            labels.push_back(s.what + " " + (s.node ? s.node->name : std::string()));
        }
        return labels;
    }

    // The first eager plan of each shape is left out: its run loads modules lazily and lets
    // cuBLAS pick its kernels, which the runs after it do not pay.
    void merge_profile(const graph_plan& p) {
        if (p.replay_profile) p.replay_profile->merge_into(profiles_[p.title + ", graph replays"]);
        if (p.eager_profile && !profile_warmups_.insert(p.title).second) {
            p.eager_profile->merge_into(profiles_[p.title + ", eager runs after the first"]);
        }
    }

    void run_eager(graph_plan& p, const exec_env& env) {
        step_profile* prof = nullptr;
        if (profile_ && !sync_each_) {
            if (!p.eager_profile) {
                p.eager_profile = std::make_unique<step_profile>();
                p.eager_profile->set_labels(step_labels(p));
            }
            prof = p.eager_profile.get();
        }
        lanes lane(*this, p, env);
        for (size_t i = 0; i < p.launches.steps.size(); ++i) {
            const launch_step& s = p.launches.steps[i];
            if (prof) {
                // Eager launches are timed one at a time (the queue drained first), so a launch
                // that stalls the host shows up in its own row, not in the next one's.
                CUDA_CHECK(cudaStreamSynchronize(env.stream));
                CUDA_CHECK(cudaStreamSynchronize(side_stream_.get()));
                prof->mark(i, env.stream, false);
            }
            const exec_env& at = lane.before(s);
            run_step(s, at);
            if (sync_each_) {
                const cudaError_t err = cudaStreamSynchronize(at.stream);
                if (err != cudaSuccess) {
                    throw error(std::string("cuda ") + s.what + " for '" +
                                (s.node ? s.node->name : std::string()) +
                                "' failed: " + cudaGetErrorString(err));
                }
            }
        }
        lane.finish();
        if (prof) {
            prof->mark(p.launches.steps.size(), env.stream, false);
            prof->collect(env.stream);
        }
        ++p.eager_runs;
    }

    void capture(const graph& g, graph_plan& p, const exec_env& env) {
        p.recording = graph_exec();
        step_profile* prof = nullptr;
        if (profile_) {
            p.replay_profile = std::make_unique<step_profile>();
            p.replay_profile->set_labels(step_labels(p));
            prof = p.replay_profile.get();
        }
        CUDA_CHECK(cudaStreamBeginCapture(stream_.get(), cudaStreamCaptureModeThreadLocal));
        exec_env capturing = env;
        capturing.captured = true;
        try {
            lanes lane(*this, p, capturing);
            for (size_t i = 0; i < p.launches.steps.size(); ++i) {
                if (prof) prof->mark(i, stream_.get(), true);
                const launch_step& s = p.launches.steps[i];
                run_step(s, lane.before(s));
            }
            lane.finish();  // a capture must end on the stream it began on, joined
            if (prof) prof->mark(p.launches.steps.size(), stream_.get(), true);
        } catch (...) {
            cudaGraph_t partial = nullptr;
            (void)cudaStreamEndCapture(stream_.get(), &partial);
            if (partial) (void)cudaGraphDestroy(partial);
            (void)cudaGetLastError();
            throw;
        }
        cudaGraph_t captured = nullptr;
        CUDA_CHECK(cudaStreamEndCapture(stream_.get(), &captured));
        graph_handle owned(captured);
        p.recording = graph_exec(captured);
        if (verbose_) {
            std::fprintf(stderr, "cuda: captured graph %llu (%zu launches)\n",
                         (unsigned long long)g.version, p.launches.steps.size());
        }
    }

    void check_device_error() {
        device_error* e = host_error();
        if (e->code == no_error) return;
        const device_error seen = *e;
        *e = device_error{};
        if (seen.code == get_rows_id_out_of_range) {
            throw error("get_rows: id " + std::to_string(seen.value) + " at position " +
                        std::to_string(seen.position) + " is outside the table's " +
                        std::to_string(seen.limit) + " rows");
        }
        throw error("cuda backend: a kernel reported error " + std::to_string(seen.code));
    }

    int device_;
    bool graphs_, pdl_, verbose_, sync_each_, profile_, replay_timing_;
    fusion_switches fusions_;
    cuda::stream stream_;
    // The side stream (fusion_plan::side: an expert cache's prefetch) and the events that fork
    // it from the main stream and join it back. (A side stream of the highest priority measured
    // no different.)
    cuda::stream side_stream_;
    cuda::event fork_, join_;
    cublas_handle cublas_;
    pinned_memory error_record_;
    device_error* error_device_ = nullptr;
    workspace matmul_ws_, scratch_, tickets_;
    std::map<const rope_params*, std::pair<std::shared_ptr<const rope_params>, device_memory>>
        rope_tables_;
    std::unordered_map<uint64_t, std::unique_ptr<graph_plan>> plans_;
    std::unordered_map<uint64_t, uint64_t> last_use_;
    uint64_t clock_ = 0;
    std::map<std::string, profile_table> profiles_;  // MINIDS_CUDA_PROFILE, by graph shape
    std::set<std::string> profile_warmups_;
    replay_timer replay_timer_;  // MINIDS_CUDA_REPLAY_TIMER
};

}  // namespace
}  // namespace cuda

bool cuda_available() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return n > 0;
}

cuda_device_info cuda_info(int device) {
    cuda_device_info info;
    if (!cuda_available()) return info;
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    info.present = true;
    info.name = prop.name;
    info.sm_count = prop.multiProcessorCount;
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMemGetInfo(&info.free_bytes, &info.total_bytes));
    return info;
}

std::unique_ptr<backend> make_cuda_backend(const cuda_options& options) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        (void)cudaGetLastError();
        fail(__FILE__, __LINE__, "cuda backend: no CUDA device is available");
    }
    MGL_CHECK(
        options.device >= 0 && options.device < n,
        "cuda backend: device " + std::to_string(options.device) + " of " + std::to_string(n));
    return std::make_unique<cuda::cuda_backend>(options);
}

cuda_graph_info cuda_graph_info_of(backend& be, const graph& g) {
    auto* cb = dynamic_cast<cuda::cuda_backend*>(&be);
    MGL_CHECK(cb != nullptr,
              std::string("cuda_graph_info_of: backend '") + be.name() + "' is not a CUDA backend");
    return cb->info(g);
}

}  // namespace mgl
