// A CUPTI activity tracer loaded by the CUDA driver into any program (no change to it):
//
//   MINIDS_KERNEL_TRACE=trace.txt CUDA_INJECTION64_PATH=build/libminids_kernel_trace.so \
//       build/minids bench ...
//
// It records every kernel (graph nodes included: each carries its graph and node id, and the
// correlation id of the graph launch it ran in, which tells replays apart) and every memcpy,
// with the device's start and end timestamps, and writes them as text at exit, one per line:
//
//   K start end graph node correlation stream grid_x grid_y block_x name
//   C start end bytes stream copy_kind src_kind dst_kind correlation
//
// Why: the replayed decode step is one graph of ~250 kernels chained with programmatic dependent
// launch; CUDA events around it say how long it took, not where inside it the time went, and
// this machine's toolkit has no Nsight Systems. scripts/kernel_trace/report.py reads the file.
#include <cupti.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8u << 20;

std::mutex g_mutex;
std::vector<std::string> g_lines;  // formatted records, written at exit
std::atomic<bool> g_failed{false};

void check(CUptiResult r, const char* what) {
    if (r == CUPTI_SUCCESS) return;
    const char* msg = nullptr;
    cuptiGetResultString(r, &msg);
    std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, msg ? msg : "?");
    g_failed = true;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
    *size = *buffer ? kBufferBytes : 0;
    *max_records = 0;
}

void format_record(const CUpti_Activity* rec, std::vector<std::string>& out) {
    char line[512];
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        std::snprintf(line, sizeof line, "K %llu %llu %u %llu %u %u %d %d %d %s",
                      (unsigned long long)k->start, (unsigned long long)k->end, k->graphId,
                      (unsigned long long)k->graphNodeId, k->correlationId, k->streamId, k->gridX,
                      k->gridY, k->blockX, k->name ? k->name : "?");
        out.emplace_back(line);
    } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
        const auto* c = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        std::snprintf(line, sizeof line, "C %llu %llu %llu %u %u %u %u %u",
                      (unsigned long long)c->start, (unsigned long long)c->end,
                      (unsigned long long)c->bytes, c->streamId, unsigned(c->copyKind),
                      unsigned(c->srcKind), unsigned(c->dstKind), c->correlationId);
        out.emplace_back(line);
    }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    std::vector<std::string> lines;
    CUpti_Activity* rec = nullptr;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS)
        format_record(rec, lines);
    std::free(buffer);
    std::lock_guard<std::mutex> lock(g_mutex);
    for (auto& l : lines) g_lines.push_back(std::move(l));
}

void write_trace() {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    const char* path = std::getenv("MINIDS_KERNEL_TRACE");
    if (!path || !*path) path = "kernel_trace.txt";
    std::FILE* f = std::fopen(path, "w");
    if (!f) {
        std::fprintf(stderr, "kernel_trace: cannot write %s\n", path);
        return;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    for (const auto& l : g_lines) std::fprintf(f, "%s\n", l.c_str());
    std::fclose(f);
    std::fprintf(stderr, "kernel_trace: %zu records to %s%s\n", g_lines.size(), path,
                 g_failed ? " (CUPTI reported an error above)" : "");
}

}  // namespace

// The driver calls this once, when the program initializes CUDA (CUDA_INJECTION64_PATH).
extern "C" int InitializeInjection() {
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
          "cuptiActivityRegisterCallbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
    std::atexit(write_trace);
    return 1;
}
