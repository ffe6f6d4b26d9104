// Internal to src/mds: the manifest's "config" and "tokenizer" objects (see manifest_config.cpp).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "tokenizer/tokenizer_data.h"

namespace minids::mds {

// Strict parses, bounds included (validate_config); throw FileError naming the field.
ModelConfig parse_manifest_config(const nlohmann::json& j, const std::string& file);
TokenizerData parse_manifest_tokenizer(const nlohmann::json& j, const std::string& file);

}  // namespace minids::mds
