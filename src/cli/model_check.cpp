#include "cli/model_check.h"

#include "chat/chat_template.h"

namespace minids::cli {

CheckedModel check_model(std::unique_ptr<mds::MdsFile> file, mgl::backend& backend,
                         const WeightOptions& options) {
    CheckedModel m;
    const std::string path = file->path();
    m.file = std::move(file);
    m.model = std::make_unique<Deepseek2Model>(*m.file, backend, options);
    try {
        m.tokenizer = std::make_unique<Tokenizer>(m.file->tokenizer());
    } catch (const TokenizerError& e) {
        throw mds::FileError(path + ": " + e.what());
    }
    const Tokenizer& tok = *m.tokenizer;
    const std::string& source = tok.data().chat_template;
    if (!source.empty()) {
        try {
            check_chat_template(source, tok.bos_id() ? tok.token_text(*tok.bos_id()) : "",
                                tok.eos_id() ? tok.token_text(*tok.eos_id()) : "");
        } catch (const ChatTemplateError& e) {
            throw mds::FileError(path + ": tokenizer.chat_template: expected a template minids " +
                                 "can render, found: " + e.what());
        }
    }
    return m;
}

CheckedModel open_checked_model(const std::string& path, mgl::backend& backend,
                                const WeightOptions& options) {
    return check_model(mds::MdsFile::open(path), backend, options);
}

}  // namespace minids::cli
