// Writing an .mds file (layout: src/mds/format.h), reusable by the converter and by tests.
//
// Three phases, because the manifest (which records every offset) precedes the data:
//   1. plan:   add_tensor / set_experts + add_expert_blob, set_config / set_tokenizer /
//              set_provenance; then plan() fixes every offset. Checksums are 16 hex digits, so
//              the manifest's length is known before any checksum is.
//   2. write:  open() creates OUT.tmp at its final size; write_tensor / write_blob (thread-safe,
//              any order) hash and pwrite each item at its planned offset.
//   3. commit: writes manifest and preamble with the real checksums, fsyncs, renames OUT.tmp to
//              OUT. A writer destroyed before commit() removes OUT.tmp, and so does a signal that
//              ends the process, so a failed or interrupted conversion leaves no file behind.
// The bytes depend only on what was added (never on timing or thread count).
//
//     mds::MdsWriter w("model.mds", /*overwrite=*/false);
//     size_t t = w.add_tensor("model.norm.weight", mgl::dtype::bf16, {2048});
//     w.set_config(config_to_json(cfg)); w.set_tokenizer(...); w.set_provenance(...);
//     w.plan(); w.open();
//     w.write_tensor(t, bytes, nbytes);
//     w.commit();
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mds/format.h"
#include "mgl.h"
#include "util/output_file.h"

namespace minids::mds {

// Misuse of the writer (internal fault) or an I/O failure, with file/line or the path.
struct WriterError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// One expert blob: gate | up | down | gate_scale | up_scale | down_scale, each part starting on a
// 256-byte boundary inside the blob; blob_nbytes is the end of the last part (not rounded).
// Scales exist only for f8_e4m3.
struct ExpertLayout {
    struct Part {
        const char* name = "";
        uint64_t offset = 0;  // within the blob
        mgl::dtype dtype = mgl::dtype::f8_e4m3;
        std::vector<int64_t> shape;
        uint64_t nbytes = 0;
    };
    mgl::dtype dtype = mgl::dtype::f8_e4m3;
    int64_t n_embd = 0;
    int64_t n_ff = 0;
    std::vector<Part> parts;  // gate, up, down[, gate_scale, up_scale, down_scale]
    uint64_t blob_nbytes = 0;

    static ExpertLayout make(mgl::dtype dtype, int64_t n_embd, int64_t n_ff);  // bf16 or f8_e4m3
    const Part& part(const char* name) const;
    nlohmann::json to_json() const;  // the manifest's "layout" object
};

// A zero-filled byte buffer aligned to 4096 whose allocation is rounded up to a multiple of 4096,
// with zeros after size(): what O_DIRECT needs. Writing items from one lets the writer skip the
// page cache (copying into it dominated conversion time on the VMs we measured; see docs/perf.md).
// Keep the bytes after size() zero.
class AlignedBuffer {
public:
    AlignedBuffer() = default;
    explicit AlignedBuffer(size_t n) { resize(n); }
    // Bytes [0, min(old, n)) are kept; [min(old, n), padded_size()) become zero.
    void resize(size_t n);
    uint8_t* data() { return mem_.get(); }
    const uint8_t* data() const { return mem_.get(); }
    size_t size() const { return size_; }
    size_t padded_size() const {
        return (size_ + mds_alignment - 1) / mds_alignment * mds_alignment;
    }

private:
    struct Free {
        void operator()(uint8_t* p) const;
    };
    std::unique_ptr<uint8_t, Free> mem_;
    size_t size_ = 0;
    size_t capacity_ = 0;
};

// Hex form used in the manifest ("xxh3": 16 lower-case hex digits).
std::string xxh3_hex(uint64_t h);

class MdsWriter {
public:
    MdsWriter(std::filesystem::path out_path, bool overwrite);
    ~MdsWriter();  // removes OUT.tmp unless committed
    MdsWriter(const MdsWriter&) = delete;
    MdsWriter& operator=(const MdsWriter&) = delete;

    // ---- plan ----
    size_t add_tensor(const std::string& name, mgl::dtype dtype, std::vector<int64_t> shape);
    void set_experts(const ExpertLayout& layout);
    size_t add_expert_blob(int64_t layer, int64_t expert);  // added in (layer, expert) order
    void set_config(nlohmann::json config) { config_ = std::move(config); }
    void set_tokenizer(nlohmann::json tokenizer) { tokenizer_ = std::move(tokenizer); }
    void set_provenance(nlohmann::json provenance) { provenance_ = std::move(provenance); }
    void plan();

    // ---- planned layout (valid after plan()) ----
    uint64_t file_size() const { return file_size_; }
    uint64_t data_offset() const { return data_offset_; }
    uint64_t tensor_offset(size_t id) const { return tensors_.at(id).offset; }
    uint64_t tensor_nbytes(size_t id) const { return tensors_.at(id).nbytes; }
    uint64_t blob_offset(size_t id) const { return blobs_.at(id).offset; }
    const ExpertLayout& expert_layout() const { return layout_; }
    size_t n_tensors() const { return tensors_.size(); }
    size_t n_blobs() const { return blobs_.size(); }
    uint64_t dense_bytes() const;
    uint64_t expert_bytes() const { return uint64_t(blobs_.size()) * layout_.blob_nbytes; }
    const std::filesystem::path& out_path() const { return out_path_; }
    std::filesystem::path tmp_path() const;

    // ---- write ----
    void open();
    // Thread-safe. Bypass the page cache with O_DIRECT where the file system allows it (caller
    // memory through bounce buffers; an AlignedBuffer directly).
    void write_tensor(size_t id, const void* data, uint64_t nbytes);
    void write_blob(size_t id, const void* data, uint64_t nbytes);
    void write_tensor(size_t id, const AlignedBuffer& buf);
    void write_blob(size_t id, const AlignedBuffer& buf);
    uint64_t bytes_written() const { return bytes_written_.load(); }
    void commit();

private:
    struct Item {
        std::string name;               // tensors
        int64_t layer = 0, expert = 0;  // blobs
        mgl::dtype dtype = mgl::dtype::bf16;
        std::vector<int64_t> shape;
        uint64_t offset = 0;
        uint64_t nbytes = 0;
        uint64_t xxh3 = 0;
        std::atomic<bool> written{false};
        Item() = default;
        Item(Item&& o) noexcept
            : name(std::move(o.name)),
              layer(o.layer),
              expert(o.expert),
              dtype(o.dtype),
              shape(std::move(o.shape)),
              offset(o.offset),
              nbytes(o.nbytes),
              xxh3(o.xxh3),
              written(o.written.load()) {}
    };
    nlohmann::json manifest(bool with_checksums) const;
    void write_item(Item& item, const void* data, uint64_t nbytes, const char* what,
                    const AlignedBuffer* direct);
    void pwrite_all(int fd, const void* data, uint64_t nbytes, uint64_t offset);
    bool write_direct_bounced(const Item& item, const uint8_t* data, uint64_t nbytes);
    std::unique_ptr<AlignedBuffer> take_bounce();
    void give_bounce(std::unique_ptr<AlignedBuffer> b);

    std::filesystem::path out_path_;
    bool overwrite_ = false;
    nlohmann::json config_, tokenizer_, provenance_;
    std::vector<Item> tensors_;
    std::vector<Item> blobs_;
    bool has_experts_ = false;
    ExpertLayout layout_;
    bool planned_ = false;
    uint64_t manifest_len_ = 0;
    uint64_t data_offset_ = 0;
    uint64_t file_size_ = 0;
    int fd_ = -1;
    int direct_fd_ = -1;  // O_DIRECT descriptor of the same file, -1 if unsupported
    std::atomic<bool> direct_ok_{true};
    // Reusable aligned buffers for writing caller memory (e.g. a mapped checkpoint) with O_DIRECT.
    std::mutex bounce_mu_;
    std::vector<std::unique_ptr<AlignedBuffer>> bounce_free_;
    bool committed_ = false;
    std::atomic<uint64_t> bytes_written_{0};
    // OUT.tmp is removed also when a signal ends the process (util/output_file.h).
    std::unique_ptr<TempFileRegistration> tmp_registration_;
};

}  // namespace minids::mds
