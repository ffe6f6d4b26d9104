// Internal-fault reporting shared by the whole library.
#include "mgl.h"

namespace mgl {

void fail(const char* file, int line, const std::string& msg) {
    throw error(std::string(file) + ":" + std::to_string(line) + ": " + msg);
}

}  // namespace mgl
