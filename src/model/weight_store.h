// Where a model's weights live for the backend that runs it.
//
// The model binds every weight to its bytes in the mapped .mds file and registers it here; place()
// then decides. A backend that computes in host memory (the CPU) reads the mapping itself:
// nothing is copied. A backend with its own memory (CUDA) gets one copy of everything, made once
// at load: the dense weights in one buffer, the routed experts' blobs in another, copied from the
// mapping (pageable copies by default; registering the whole mapping first proved slower on a
// file outside the page cache, see weight_store.cpp; MINIDS_HOST_REGISTER=1 does it). Merged
// weights (rows of several checkpoint tensors stacked, for one matmul instead of several) exist
// only in copied stores.
//
// With experts_resident = false (an expert cache) the routed experts stay in host memory: by
// default a copy of their span in anonymous memory, registered with the backend; else the file
// mapping itself, registered (place_experts_in_host_memory says why the copy is the default);
// where neither can be registered (or MINIDS_EXPERT_STORE=staging), the mapping unregistered,
// which the expert cache then reads only through pinned staging buffers (the staging store).
//
// Each MoE layer gets an expert table, an i64 tensor [n_experts] holding the address of each
// expert's blob in the backend's memory: that is what moe_experts reads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "mds/reader.h"
#include "mgl.h"

namespace minids {

// Bytes of host memory available to a new allocation without swapping (MemAvailable of
// /proc/meminfo); 0 when unknown.
uint64_t available_host_memory();

// The experts' host store that MINIDS_EXPERT_STORE asks an expert cache for
// (docs/expert-cache.md): unset or "copy": a registered copy in anonymous memory (the default; the
// registered mapping when there is no room for it), "mapped": the registered file mapping,
// "staging": nothing registered, every miss copied through pinned staging buffers. Throws
// std::invalid_argument naming the variable for any other value.
enum class ExpertStoreRequest { copy, mapped, staging };
ExpertStoreRequest expert_store_request();

// Private anonymous memory (mmap), unmapped on destruction; data() is null when the system
// refused.
class AnonymousMemory {
public:
    // `huge_pages`: asks for transparent huge pages (MADV_HUGEPAGE).
    explicit AnonymousMemory(size_t bytes, bool huge_pages = true);
    ~AnonymousMemory();
    AnonymousMemory(const AnonymousMemory&) = delete;
    AnonymousMemory& operator=(const AnonymousMemory&) = delete;
    uint8_t* data() const { return p_; }

private:
    uint8_t* p_ = nullptr;
    size_t n_ = 0;
};

struct WeightOptions {
    // Stack the rows of the first query projection and kv_a_proj_with_mqa into one weight when
    // the weights are copied anyway (one matmul over the shared input instead of two).
    bool merge_projections = true;
    // Copy the routed experts into backend memory (a copying store). false leaves them in the
    // mapping, registered with the backend so its kernels read them in place over the bus, for
    // an expert cache (runtime/expert_offload.h) to hold the ones in use.
    bool experts_resident = true;
    // Called while copying: bytes done, bytes in all (only when copying).
    std::function<void(uint64_t, uint64_t)> progress;
    // With experts_resident = false: the staging store whatever could be registered (what
    // MINIDS_EXPERT_STORE=staging asks for), so both the registered and the staged paths can be
    // tested on one machine. On a backend that computes in host memory (the CPU) it only marks
    // the placement (experts_staged), so the expert cache runs its staged bookkeeping there too.
    bool stage_experts = false;
};

struct WeightPlacement {
    bool copied = false;            // weights copied into backend memory
    bool registered = false;        // the mapping was registered for the copy
    bool staged = false;            // copied through pinned staging buffers (StagedCopier)
    bool experts_in_place = false;  // experts stay in host memory (not copied to the device)
    bool experts_pinned = false;    // ... as a registered copy, not the registered mapping
    // ... in the mapping, unregistered (the staging store): table homes are host addresses the
    // device cannot read, so the expert cache must fetch every miss through pinned staging.
    bool experts_staged = false;
    uint64_t dense_bytes = 0;     // dense weights (incl. merged copies)
    uint64_t expert_bytes = 0;    // routed expert blobs
    uint64_t table_bytes = 0;     // expert tables
    double seconds = 0.0;         // wall time of place()
    std::string memory = "host";  // where the backend reads them
};

class WeightStore {
public:
    // Takes options.experts_resident and options.stage_experts.
    WeightStore(const mds::MdsFile& file, mgl::backend& backend, const WeightOptions& options = {});
    ~WeightStore();
    WeightStore(const WeightStore&) = delete;
    WeightStore& operator=(const WeightStore&) = delete;

    // True when place() will copy (the backend does not compute in host memory).
    bool copies() const;

    // A leaf whose data is `host` (nbytes in the mapping) until place() moves it.
    void add(mgl::tensor* t, const uint8_t* host, uint64_t nbytes);
    // A leaf made of the concatenation of host byte ranges (only when copies()).
    void add_concat(mgl::tensor* t, std::vector<std::span<const uint8_t>> parts);
    // A leaf whose bytes the caller computed (a re-laid-out copy; only when copies()). The store
    // keeps them until place() has copied them.
    void add_owned(mgl::tensor* t, std::vector<uint8_t> bytes);
    // The expert table of one MoE layer, a leaf [blobs.size()] i64 created in ctx; its entries
    // are the addresses of the blobs after place().
    mgl::tensor* add_expert_table(mgl::context& ctx, int64_t layer,
                                  std::vector<const uint8_t*> blobs, uint64_t blob_bytes);

    // Drops a leaf added before whose bytes another leaf now holds (the parts of a merged
    // weight): it is not copied, and its data stays the mapping, which a device backend refuses
    // to read, so a forgotten use fails loudly.
    void forget(const mgl::tensor* t);
    // Allocates, copies and binds everything added. Call once, after the last add.
    void place(const std::function<void(uint64_t, uint64_t)>& progress = {});
    const WeightPlacement& placement() const { return placement_; }

    // One MoE layer's expert table after place(): the tensor the kernels read, each expert's
    // bytes in host memory (the mapping, or its pinned copy when the experts stay in host
    // memory), and the address place() wrote for it (its copy in backend memory, or the host
    // copy as the backend addresses it).
    struct ExpertTable {
        mgl::tensor* t = nullptr;
        std::vector<const uint8_t*> blobs;
        uint64_t blob_bytes = 0;
        std::vector<int64_t> home;
    };
    const std::vector<ExpertTable>& expert_tables() const { return tables_; }

private:
    // [first byte, size) of the bytes that hold every expert blob in the mapping.
    std::pair<const uint8_t*, uint64_t> expert_span() const;
    // experts_resident == false: the experts' host store (a pinned copy, else the registered
    // mapping, else the mapping unregistered: staged); appends each blob's address for the
    // kernels (its host address when staged), reports bytes as it copies.
    void place_experts_in_host_memory(std::vector<int64_t>& addresses,
                                      const std::function<void(uint64_t)>& copied,
                                      const std::function<void(const char*)>& stamp);
    // The staging store: the mapping as is, unregistered.
    void place_experts_staged(std::vector<int64_t>& addresses,
                              const std::function<void(uint64_t)>& copied);

    struct Item {
        mgl::tensor* t = nullptr;
        std::vector<std::span<const uint8_t>> parts;
        uint64_t offset = 0;  // in the dense buffer
    };

    const mds::MdsFile& file_;
    mgl::backend& backend_;
    bool experts_resident_ = true;
    bool stage_experts_ = false;
    std::vector<Item> items_;
    std::vector<std::vector<uint8_t>> owned_;
    std::vector<ExpertTable> tables_;
    // The experts' host store when they stay in host memory: their copy (declared first, so
    // it is unregistered before it is unmapped), else the mapping, registered.
    std::unique_ptr<AnonymousMemory> expert_copy_;
    std::unique_ptr<mgl::host_registration> expert_registration_;
    mgl::buffer_ptr dense_, experts_, tables_buf_;
    WeightPlacement placement_;
};

}  // namespace minids
