// Everything loading a model checks beyond the manifest, in one place, so that `info --verify`
// refuses exactly what `run` and `chat` would: the weights bind by name and shape, the tokenizer
// builds (regexes, merges, vocabulary), and the model's chat template parses and renders a few
// short conversations within its limits.
#pragma once

#include <memory>
#include <string>

#include "mds/reader.h"
#include "mgl.h"
#include "model/deepseek2.h"
#include "tokenizer/tokenizer.h"

namespace minids::cli {

// The backend the weights were bound for must outlive the model.
struct CheckedModel {
    std::unique_ptr<mds::MdsFile> file;
    std::unique_ptr<Deepseek2Model> model;
    std::unique_ptr<Tokenizer> tokenizer;
};

// Opens `path` and runs every load check, binding the weights for `backend`. Throws
// mds::FileError naming the file and what failed.
CheckedModel open_checked_model(const std::string& path, mgl::backend& backend,
                                const WeightOptions& options = {});

// The checks after the manifest, on an opened file.
CheckedModel check_model(std::unique_ptr<mds::MdsFile> file, mgl::backend& backend,
                         const WeightOptions& options = {});

}  // namespace minids::cli
