// Internal to src/mds: the tensors a DeepSeek-V2 config requires, by checkpoint name and shape.
#pragma once

#include <string>
#include <vector>

#include "mds/reader.h"

namespace minids::mds {

// Every required tensor present with the shape the config implies and a float dtype; no tensor
// the config does not expect. Throws FileError naming the tensor, expected and found.
void check_model_tensors(const std::vector<TensorEntry>& tensors, const ModelConfig& config,
                         const std::string& file);

}  // namespace minids::mds
