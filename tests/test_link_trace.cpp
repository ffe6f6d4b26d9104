// The link trace's summary (MINIDS_LINK_TRACE; ggml-like/cuda/link_trace.h): host only.
#include <doctest/doctest.h>

#ifdef MINIDS_HAVE_CUDA

#include <string>
#include <vector>

#include "../ggml-like/cuda/link_trace.h"

TEST_CASE("link trace: copies and the gaps between them, by size (host only)") {
    // Four copies of 8 MiB at 0.16 ms; the second queued behind the first, the third 80 us after
    // the second, the fourth after 3 ms (between phases: shown, not counted as idle).
    const std::vector<double> copy_ms{0.16, 0.16, 0.16, 0.16};
    const std::vector<double> gap_ms{-0.01, 0.08, 3.0};
    const std::string s = mgl::cuda::link_trace::summarize(copy_ms, gap_ms, 4 * (8u << 20));
    CAPTURE(s);
    CHECK(s.find("4 copies, 32.00 MiB in 0.64 ms (52.43 GB/s while copying)") != std::string::npos);
    CHECK(s.find("idle between copies (gaps under 2 ms) 0.08 ms") != std::string::npos);
    CHECK(s.find("gap < 2.00 us: 1 gaps") != std::string::npos);
    CHECK(s.find("gap 60.00-100.00 us: 1 gaps, 0.08 ms (mean 80.00 us)") != std::string::npos);
    CHECK(s.find("gap >= 2000.00 us (not counted): 1 gaps, 3.00 ms") != std::string::npos);
    CHECK(s.find("10.00-30.00") == std::string::npos);  // empty sizes are left out
}

#endif  // MINIDS_HAVE_CUDA
