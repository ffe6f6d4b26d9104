# Writes OUT (a header) with the source tree's git commit, for `minids --version`: a GPU run of
# binaries built elsewhere then says which commit it measured. Run at every build by the
# build_commit target; the header is rewritten only when its text changes, so only main.cpp
# recompiles after a commit.
execute_process(COMMAND git -C "${SRC}" describe --always --dirty --abbrev=10
                OUTPUT_VARIABLE commit OUTPUT_STRIP_TRAILING_WHITESPACE
                RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0 OR commit STREQUAL "")
  set(commit "unknown")
endif()
set(text "#define MINIDS_BUILD_COMMIT \"${commit}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
else()
  set(old "")
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()
