// Stop strings in streamed chat output: held back while they might start, cut where they match.
#include <doctest/doctest.h>

#include "runtime/stop_strings.h"

using minids::StopStringFilter;

TEST_CASE("chat stop strings: text is released once it cannot start a stop string") {
    StopStringFilter f({"\n\nUser:", "<eos>"});
    std::string out;
    out += f.push("Hello");
    CHECK(out == "Hello");
    out += f.push(" wor");
    out += f.push("ld\n");
    CHECK(out == "Hello world");  // "\n" may start "\n\nUser:"
    out += f.push("\nUs");
    CHECK(out == "Hello world");
    out += f.push("e");
    out += f.push("d it<e");  // "\n\nUse" + "d" breaks the first stop string
    CHECK(out == "Hello world\n\nUsed it");
    out += f.push("os> more");
    CHECK(f.stopped());
    CHECK(out == "Hello world\n\nUsed it");
    CHECK(f.push("ignored") == "");
    CHECK(f.flush() == "");
    CHECK(f.released() == "Hello world\n\nUsed it");
}

TEST_CASE("chat stop strings: a stop string inside one piece, and flush without a stop") {
    StopStringFilter f({"STOP"});
    CHECK(f.push("abcSTOPdef") == "abc");
    CHECK(f.stopped());
    StopStringFilter g({"STOP"});
    CHECK(g.push("xyST") == "xy");
    CHECK(g.flush() == "ST");
    CHECK(!g.stopped());
    CHECK(g.released() == "xyST");
    StopStringFilter none({});
    CHECK(none.push("anything\n") == "anything\n");
}
