// Random-weight models of exact real shapes (`minids convert --synthetic PRESET`), so speed and
// memory can be measured without downloading a checkpoint.
//
// Presets: "tiny" (a few MB: V2 features at toy sizes — q_lora, group-limited routing, YaRN),
// "v2-lite" (DeepSeek-V2-Lite's config.json), "v2" (DeepSeek-V2's, 236B; hundreds of GB).
// Weights: linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms = 1. Values come from a
// counter-based generator keyed by (seed, tensor, row), so the bytes do not depend on the thread
// count. FP8 experts are drawn directly as E4M3 codes from a 256-level quantized normal whose
// extremes (z = ±2.66) map to ±448, with a per-row scale σ·2.66/448 · U(0.75, 1.25): no float
// is generated or quantized, which keeps generation well above the disk's speed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "convert/convert.h"
#include "model/config.h"

namespace minids::convert {

std::vector<std::string> synthetic_presets();
// Throws InputError naming the known presets.
ModelConfig synthetic_config(const std::string& preset);

struct SyntheticOptions {
    std::string preset;
    uint64_t seed = 0;
    std::filesystem::path out;
    mgl::dtype expert_dtype = mgl::dtype::f8_e4m3;
    int threads = 0;
    bool force = false;
    bool progress = true;
    bool dry_run = false;  // plan the layout and report sizes; write nothing
};

// Throws InputError, Interrupted, mds::WriterError.
ConvertStats write_synthetic(const SyntheticOptions& opt);

}  // namespace minids::convert
