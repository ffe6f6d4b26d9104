// The CPU backend: host buffers, a grow-only arena for intermediates, a thread pool, and one
// switch over ops.
#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>

#include "cpu_ops.h"

namespace mgl {

namespace {

class host_buffer final : public buffer {
public:
    explicit host_buffer(size_t bytes) : size_(bytes) {
        // 64-byte alignment for SIMD loads; aligned_alloc needs a size that is a multiple of it.
        size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
        data_ = std::aligned_alloc(64, rounded);
        if (!data_)
            throw error("cpu backend: cannot allocate " + std::to_string(bytes) +
                        " bytes of host memory");
    }
    ~host_buffer() override { std::free(data_); }
    host_buffer(const host_buffer&) = delete;
    host_buffer& operator=(const host_buffer&) = delete;
    void* base() override { return data_; }
    size_t size() const override { return size_; }
    memory_kind kind() const override { return memory_kind::host; }

private:
    void* data_ = nullptr;
    size_t size_ = 0;
};

// The CPU reads host memory where it is: registering is a no-op.
struct identity_registration final : host_registration {
    const void* device_address(const void* p) const override { return p; }
};

class cpu_backend final : public backend {
public:
    explicit cpu_backend(int n_threads) : pool_(n_threads), kernels_(cpu::best_matmul_kernels()) {}
    cpu_backend(int n_threads, const cpu::matmul_kernels& kernels)
        : pool_(n_threads), kernels_(kernels) {}

    const char* name() const override { return "cpu"; }

    bool supports_op(const tensor& node) const override {
        switch (node.op_kind) {
            case op::count:
                return false;
            case op::matmul:
                return kernels_.for_type(node.src[1] ? node.src[1]->type : dtype::i32) != nullptr;
            default:
                return true;
        }
    }

    memory_kind compute_memory() const override { return memory_kind::host; }

    buffer_ptr alloc_buffer(size_t bytes) override { return std::make_unique<host_buffer>(bytes); }
    buffer_ptr alloc_host_buffer(size_t bytes) override {
        return std::make_unique<host_buffer>(bytes);
    }
    std::unique_ptr<host_registration> register_host(const void*, size_t, bool) override {
        return std::make_unique<identity_registration>();
    }

    void upload(tensor& t, const void* src, size_t offset, size_t n) override {
        MGL_CHECK(t.data != nullptr, "upload into '" + t.name + "', which has no memory");
        MGL_CHECK(offset + n <= nbytes(t), "upload of " + std::to_string(n) + " bytes at " +
                                               std::to_string(offset) + " into '" + t.name +
                                               "' of " + std::to_string(nbytes(t)) + " bytes");
        std::memcpy(static_cast<char*>(t.data) + offset, src, n);
    }

    void download(const tensor& t, void* dst, size_t offset, size_t n) override {
        MGL_CHECK(t.data != nullptr, "download from '" + t.name + "', which has no memory");
        MGL_CHECK(offset + n <= nbytes(t), "download of " + std::to_string(n) + " bytes at " +
                                               std::to_string(offset) + " from '" + t.name +
                                               "' of " + std::to_string(nbytes(t)) + " bytes");
        std::memcpy(dst, static_cast<const char*>(t.data) + offset, n);
    }

    void upload_async(tensor& t, const void* src, size_t offset, size_t n) override {
        upload(t, src, offset, n);
    }

    void copy_to_backend(void* dst, const void* src, size_t n) override {
        std::memcpy(dst, src, n);
    }
    void copy_to_backend_async(void* dst, const void* src, size_t n) override {
        std::memcpy(dst, src, n);
    }

    void allocate(graph& g, arena& a) override {
        // Forget placements from an earlier allocate() so the graph can be re-planned.
        clear_plan(g, a.buf.get());
        alloc_plan plan = plan_allocation(g, 64);
        if (!a.buf || a.buf->size() < plan.arena_bytes) {
            a.buf = alloc_buffer(plan.arena_bytes);
            ++a.generation;
        }
        apply_plan(g, plan, *a.buf);
        g.placed_in = &a;
        g.arena_generation = a.generation;
        g.version = new_graph_version();
    }

    void compute(graph& g) override {
        check_not_stale(g);
        cpu::exec_context ex{pool_, kernels_};
        for (tensor* n : g.nodes) {
            MGL_CHECK(n->data != nullptr, std::string(op_name(n->op_kind)) + " node '" + n->name +
                                              "' has no memory: call allocate() first");
            run(ex, *n);
        }
    }

    void synchronize() override {}

private:
    static void run(cpu::exec_context& ex, tensor& n) {
        switch (n.op_kind) {
            case op::none:
            case op::view:
                return;
            case op::get_rows:
                return cpu::run_get_rows(ex, n);
            case op::matmul:
                return cpu::run_matmul(ex, n);
            case op::add:
            case op::mul:
                return cpu::run_add_mul(ex, n);
            case op::scale:
                return cpu::run_scale(ex, n);
            case op::rms_norm:
                return cpu::run_rms_norm(ex, n);
            case op::rope:
                return cpu::run_rope(ex, n);
            case op::softmax:
                return cpu::run_softmax(ex, n);
            case op::swiglu:
                return cpu::run_swiglu(ex, n);
            case op::moe_topk:
                return cpu::run_moe_topk(ex, n);
            case op::moe_weights:
                return cpu::run_moe_weights(ex, n);
            case op::moe_experts:
                return cpu::run_moe_experts(ex, n);
            case op::kv_store:
                return cpu::run_kv_store(ex, n);
            case op::mla_attn:
                return cpu::run_mla_attn(ex, n);
            case op::cpy:
                return cpu::run_cpy(ex, n);
            case op::contiguous:
                return cpu::run_contiguous(ex, n);
            case op::concat:
                return cpu::run_concat(ex, n);
            case op::expert_fetch:
                return cpu::run_expert_fetch(ex, n);
            case op::expert_prompt_stage:
                return cpu::run_expert_prompt_stage(ex, n);
            case op::count:
                break;
        }
        fail(__FILE__, __LINE__, std::string("cpu backend: unsupported op ") + op_name(n.op_kind));
    }

    cpu::thread_pool pool_;
    cpu::matmul_kernels kernels_;
};

}  // namespace

int physical_cores() {
    // Distinct (package, core) pairs; hyperthreads share one. Falls back to the logical count.
    std::set<std::pair<std::string, std::string>> cores;
    for (unsigned cpu = 0; cpu < 4096; ++cpu) {
        std::string dir = "/sys/devices/system/cpu/cpu" + std::to_string(cpu) + "/topology/";
        std::ifstream core(dir + "core_id"), package(dir + "physical_package_id");
        if (!core || !package) break;
        std::string c, p;
        core >> c;
        package >> p;
        cores.emplace(p, c);
    }
    if (!cores.empty()) return int(cores.size());
    return std::max(1, int(std::thread::hardware_concurrency()));
}

std::unique_ptr<backend> make_cpu_backend(int n_threads) {
    return std::make_unique<cpu_backend>(n_threads > 0 ? n_threads : physical_cores());
}

namespace cpu {
std::unique_ptr<backend> make_cpu_backend_with(int n_threads, const matmul_kernels& kernels) {
    return std::make_unique<cpu_backend>(n_threads > 0 ? n_threads : physical_cores(), kernels);
}
}  // namespace cpu

}  // namespace mgl
