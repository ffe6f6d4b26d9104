// The manifest's "config" and "tokenizer" objects.
//
// Parsing and checks belong to config_from_manifest_json / validate_config (src/model/config.h;
// its bounds keep every product of sizes the reader computes far below 2^63) and
// tokenizer_data_from_json (src/tokenizer/tokenizer_data.h); this file turns their errors into
// FileErrors naming the file.
#include "mds/manifest_config.h"

#include <string>

#include "mds/manifest.h"

namespace minids::mds {

using nlohmann::json;

ModelConfig parse_manifest_config(const json& j, const std::string& file) {
    try {
        return config_from_manifest_json(j);  // strict, then validate_config
    } catch (const ConfigError& e) {
        // The config's own message names the field, what it expected and what it found.
        throw FileError(file + ": " + e.what());
    }
}

TokenizerData parse_manifest_tokenizer(const json& j, const std::string& file) {
    try {
        return tokenizer_data_from_json(j);
    } catch (const TokenizerError& e) {
        throw FileError(file + ": " + e.what());
    }
}

}  // namespace minids::mds
