// The link trace's summary (MINIDS_LINK_TRACE; ggml-like/cuda/link_trace.h): host only.
#include <doctest/doctest.h>

#ifdef MINIDS_HAVE_CUDA

#include <string>
#include <vector>

#include "../ggml-like/cuda/link_trace.h"

TEST_CASE("link trace: copies and the gaps between them, by size and place (host only)") {
    // Five copies of 8 MiB at 0.16 ms: the second queued behind the first, the third 80 us after
    // the second, the fourth 300 us after it and starting a new step, the fifth after 3 ms
    // (between phases: shown, not counted as idle).
    const std::vector<double> copy_ms{0.16, 0.16, 0.16, 0.16, 0.16};
    const std::vector<double> gap_ms{-0.01, 0.08, 0.3, 3.0};
    const std::vector<bool> new_step{false, false, true, true};
    const std::string s =
        mgl::cuda::link_trace::summarize(copy_ms, gap_ms, new_step, 5 * (8u << 20));
    CAPTURE(s);
    CHECK(s.find("5 copies, 40.00 MiB in 0.80 ms (52.43 GB/s while copying)") != std::string::npos);
    CHECK(s.find("idle between copies (gaps of 2 us to 2 ms) 0.38 ms: 0.30 ms in 1 gaps before a "
                 "step's first copy, 0.08 ms in 1 within steps") != std::string::npos);
    CHECK(s.find("within steps, gap < 2.00 us: 1 gaps\n") != std::string::npos);
    CHECK(s.find("within steps, gap 60.00-100.00 us: 1 gaps, 0.08 ms (mean 80.00 us)") !=
          std::string::npos);
    CHECK(s.find("before a step's first copy, gap 200.00-500.00 us: 1 gaps, 0.30 ms (mean 300.00 "
                 "us)") != std::string::npos);
    CHECK(s.find("before a step's first copy, gap >= 2000.00 us (not counted): 1 gaps, 3.00 ms") !=
          std::string::npos);
    CHECK(s.find("10.00-30.00") == std::string::npos);  // empty sizes are left out
}

#endif  // MINIDS_HAVE_CUDA
