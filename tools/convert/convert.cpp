#include "convert/convert.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "chat/chat_template.h"
#include "convert/jobs.h"
#include "convert/quantize.h"
#include "convert/safetensors.h"
#include "convert/tensor_plan.h"
#include "mds/writer.h"
#include "model/config.h"
#include "tokenizer/tokenizer_data.h"
#include "util/output_file.h"

namespace minids::convert {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Where a checkpoint tensor lives.
struct Source {
    size_t shard = 0;
    const StTensor* tensor = nullptr;
};

ModelConfig read_config(const fs::path& dir) {
    const fs::path path = dir / "config.json";
    json j = read_json_file(path);
    try {
        return config_from_hf_json(j);
    } catch (const ConfigError& e) {
        throw InputError(path.string() + ": " + e.what());
    }
}

json read_tokenizer(const fs::path& dir, const ModelConfig& config) {
    const fs::path tok_path = dir / "tokenizer.json";
    const fs::path cfg_path = dir / "tokenizer_config.json";
    std::error_code ec;
    if (!fs::exists(tok_path, ec))
        throw InputError(dir.string() + ": expected tokenizer.json, found none");
    json tok = read_json_file(tok_path);
    json cfg = fs::exists(cfg_path, ec) ? read_json_file(cfg_path) : json(nullptr);
    try {
        TokenizerData data = tokenizer_data_from_hf(tok, cfg);
        // Every token id must index a row of the embedding (a smaller tokenizer is normal:
        // DeepSeek pads vocab_size beyond its tokens).
        int64_t max_id = int64_t(data.vocab.size()) - 1;
        for (const AddedToken& a : data.added_tokens) max_id = std::max<int64_t>(max_id, a.id);
        if (max_id >= config.vocab_size)
            throw InputError(
                tok_path.string() + ": token ids: expected all below config.json's vocab_size " +
                std::to_string(config.vocab_size) + ", found id " + std::to_string(max_id));
        // The template is checked as loading the model will check it, so no model is written
        // that run and chat would then refuse.
        if (!data.chat_template.empty()) {
            auto text = [&](std::optional<int32_t> id) {
                return id ? data.vocab[size_t(*id)] : std::string();
            };
            try {
                check_chat_template(data.chat_template, text(data.bos_id), text(data.eos_id));
            } catch (const ChatTemplateError& e) {
                throw InputError(cfg_path.string() + ": chat_template: " + e.what());
            }
        }
        return tokenizer_data_to_json(data);
    } catch (const TokenizerError& e) {
        throw InputError(tok_path.string() + ": " + e.what());
    } catch (const nlohmann::json::exception& e) {  // a field of an unexpected JSON type
        throw InputError(tok_path.string() + ": unexpected content (" + e.what() + ")");
    }
}

// Every checkpoint tensor must be one the config expects, with the expected shape; every
// expected tensor must be present.
std::vector<Source> match_tensors(const Checkpoint& ck,
                                  const std::vector<ExpectedTensor>& expected) {
    std::unordered_map<std::string, size_t> index;
    for (size_t i = 0; i < expected.size(); ++i) index.emplace(expected[i].name, i);
    std::vector<Source> sources(expected.size());
    for (size_t s = 0; s < ck.shards.size(); ++s) {
        for (const StTensor& t : ck.shards[s].tensors) {
            auto it = index.find(t.name);
            if (it == index.end())
                throw InputError(
                    ck.shards[s].path.string() + ": tensor \"" + t.name +
                    "\": expected only tensors the config describes, found one it does not");
            const ExpectedTensor& e = expected[it->second];
            if (t.shape != e.shape)
                throw InputError(ck.shards[s].path.string() + ": tensor \"" + t.name +
                                 "\": expected shape " + shape_str(e.shape) +
                                 " (from config.json), found " + shape_str(t.shape));
            if (sources[it->second].tensor)
                throw InputError(ck.shards[s].path.string() + ": tensor \"" + t.name +
                                 "\" appears in two shards");
            sources[it->second] = {s, &t};
        }
    }
    for (size_t i = 0; i < expected.size(); ++i)
        if (!sources[i].tensor && !expected[i].optional)
            throw InputError(ck.shards.front().path.parent_path().string() + ": tensor \"" +
                             expected[i].name + "\" of shape " + shape_str(expected[i].shape) +
                             " is required by config.json but missing from the checkpoint");
    return sources;
}

// An expert blob being assembled from its three parts, possibly across shards.
struct BlobStage {
    mds::AlignedBuffer bytes;
    std::atomic<int> parts_left{3};
};

class ShardWriter {
public:
    ShardWriter(const ModelPlan& plan, const std::vector<Source>& sources,
                const mds::ExpertLayout* layout, mds::MdsWriter& w, int threads, Progress& progress)
        : plan_(plan),
          sources_(sources),
          layout_(layout),
          w_(w),
          threads_(threads),
          progress_(progress) {
        if (layout_) stages_.resize(w.n_blobs());
    }

    void write_shard(size_t shard, const StHeader& header) {
        MappedFile map(header.path);
        if (map.size() != header.file_size)
            throw InputError(header.path.string() +
                             ": the file changed size during conversion (expected " +
                             std::to_string(header.file_size) + " bytes, found " +
                             std::to_string(map.size()) + ")");
        const uint8_t* data = map.data() + header.data_start;
        // This shard's work in file order, so the mapping is read front to back.
        std::vector<size_t> items;
        for (size_t i = 0; i < plan_.tensors.size(); ++i)
            if (sources_[i].tensor && sources_[i].shard == shard) items.push_back(i);
        std::sort(items.begin(), items.end(), [&](size_t a, size_t b) {
            return sources_[a].tensor->begin < sources_[b].tensor->begin;
        });
        // Windows bound the staged expert blobs to about 2 × threads at a time.
        const size_t window = size_t(std::max(1, threads_)) * 6;
        for (size_t start = 0; start < items.size(); start += window) {
            size_t end = std::min(items.size(), start + window);
            for (size_t k = start; k < end; ++k) {
                const ExpectedTensor& e = plan_.tensors[items[k]];
                if (e.role == TensorRole::expert && !stages_[plan_.writer_id[items[k]]]) {
                    auto st = std::make_unique<BlobStage>();
                    st->bytes.resize(layout_->blob_nbytes);
                    stages_[plan_.writer_id[items[k]]] = std::move(st);
                }
            }
            parallel_for(end - start, threads_,
                         [&](size_t k) { write_item(items[start + k], data, header.path); });
        }
    }

private:
    void write_item(size_t i, const uint8_t* data, const fs::path& file) {
        const ExpectedTensor& e = plan_.tensors[i];
        const StTensor& t = *sources_[i].tensor;
        const uint8_t* src = data + t.begin;
        if (e.role != TensorRole::expert) {
            if (plan_.writer_id[i] == size_t(-1)) {  // lm_head present but embeddings are tied
                progress_.add(t.nbytes());
                return;
            }
            if (t.dtype == StDtype::bf16) {
                w_.write_tensor(plan_.writer_id[i], src, t.nbytes());
            } else {
                mds::AlignedBuffer buf(size_t(t.nelements()) * 2);
                convert_to_bf16(t.dtype, src, size_t(t.nelements()), buf.data());
                w_.write_tensor(plan_.writer_id[i], buf);
            }
            progress_.add(t.nbytes());
            return;
        }
        const size_t blob = plan_.writer_id[i];
        BlobStage& st = *stages_[blob];
        const auto& part = layout_->parts[size_t(e.part)];
        uint8_t* dst = st.bytes.data() + part.offset;
        if (layout_->dtype == mgl::dtype::bf16) {
            convert_to_bf16(t.dtype, src, size_t(t.nelements()), dst);
        } else {
            const auto& scale_part = layout_->parts[size_t(e.part) + 3];
            int64_t bad = quantize_rows_e4m3(t.dtype, src, e.shape[0], e.shape[1], dst,
                                             st.bytes.data() + scale_part.offset);
            if (bad >= 0)
                throw InputError(file.string() + ": tensor \"" + t.name + "\": row " +
                                 std::to_string(bad) +
                                 " holds a NaN or infinity; expected finite weights to quantize");
        }
        progress_.add(t.nbytes());
        if (--st.parts_left == 0) {
            w_.write_blob(blob, st.bytes);
            stages_[blob].reset();  // safe: no other part of this blob is in flight
        }
    }

    const ModelPlan& plan_;
    const std::vector<Source>& sources_;
    const mds::ExpertLayout* layout_;
    mds::MdsWriter& w_;
    int threads_;
    Progress& progress_;
    std::vector<std::unique_ptr<BlobStage>> stages_;
};

}  // namespace

ConvertStats ConvertStats::of_plan(const mds::MdsWriter& planned) {
    ConvertStats st;
    st.file_size = planned.file_size();
    st.dense_bytes = planned.dense_bytes();
    st.expert_bytes = planned.expert_bytes();
    st.n_tensors = planned.n_tensors();
    st.n_blobs = planned.n_blobs();
    return st;
}

void check_output_path(const fs::path& out, bool force) {
    try {
        check_output_file(out, force);
    } catch (const OutputError& e) {
        throw InputError(e.what());
    }
}

bool parse_expert_dtype(const std::string& s, mgl::dtype& out) {
    if (s == "fp8" || s == "f8_e4m3" || s == "e4m3")
        out = mgl::dtype::f8_e4m3;
    else if (s == "bf16")
        out = mgl::dtype::bf16;
    else
        return false;
    return true;
}

ConvertStats convert_checkpoint(const ConvertOptions& opt) {
    auto t0 = std::chrono::steady_clock::now();
    InterruptScope interrupt_scope;
    const int threads = resolve_threads(opt.threads);
    std::error_code ec;
    if (!fs::is_directory(opt.hf_dir, ec))
        throw InputError(opt.hf_dir.string() +
                         ": expected a Hugging Face checkpoint directory, found none");
    check_output_path(opt.out, opt.force);

    ModelConfig config = read_config(opt.hf_dir);
    json tokenizer = read_tokenizer(opt.hf_dir, config);
    Checkpoint ck = open_checkpoint(opt.hf_dir);

    mds::MdsWriter w(opt.out, opt.force);
    // Tied embeddings: lm_head is not stored even if the checkpoint carries a copy.
    ModelPlan plan = plan_model(config, opt.expert_dtype, !config.tie_word_embeddings, w);
    std::vector<Source> sources = match_tensors(ck, plan.tensors);

    std::string source = fs::absolute(opt.hf_dir).lexically_normal().filename().string();
    if (source.empty())
        source = fs::absolute(opt.hf_dir).lexically_normal().parent_path().filename().string();
    w.set_config(config_to_json(config));
    w.set_tokenizer(std::move(tokenizer));
    w.set_provenance({{"tool", "minids convert"},
                      {"tool_version", MINIDS_VERSION},
                      {"source", source},
                      {"source_format", "safetensors"},
                      {"expert_dtype", opt.expert_dtype == mgl::dtype::bf16 ? "bf16" : "f8_e4m3"},
                      {"synthetic", false}});
    w.plan();
    w.open();

    uint64_t total_source = 0;
    for (const StHeader& h : ck.shards) total_source += h.file_size - h.data_start;
    Progress progress("converting", total_source, opt.progress);
    const mds::ExpertLayout* layout = w.n_blobs() ? &w.expert_layout() : nullptr;
    ShardWriter sw(plan, sources, layout, w, threads, progress);
    for (size_t s = 0; s < ck.shards.size(); ++s) {
        throw_if_interrupted();
        sw.write_shard(s, ck.shards[s]);
    }
    throw_if_interrupted();
    w.commit();
    progress.finish();

    ConvertStats st = ConvertStats::of_plan(w);
    st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return st;
}

}  // namespace minids::convert
