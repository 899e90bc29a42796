# The documentation's complete programs must be the example files verbatim (the build compiles the
# examples and ctest runs them): README.md's quick start is examples/minimal.cpp (example_minimal),
# docs/policies.md's example is examples/custom_policy.cpp (example_custom_policy), docs/integration.md's
# paged decode loop is examples/paged_decode.cpp (example_paged_decode). Each example
# counts from its `#include <kvcompress/kvcompress.hpp>` line (the comment above it is not shown).
# Invoked as: cmake -DSRC=<repo root> -P readme_check.cmake
cmake_minimum_required(VERSION 3.16)

# Fails unless `doc` holds a ```cpp block whose text is `example` from its kvcompress include on.
function(expect_verbatim doc example)
  file(READ ${SRC}/${doc} text)
  file(READ ${SRC}/${example} code)
  string(FIND "${code}" "#include <kvcompress/kvcompress.hpp>" body_start)
  if(body_start EQUAL -1)
    message(FATAL_ERROR "${example}: no #include <kvcompress/kvcompress.hpp> line")
  endif()
  string(SUBSTRING "${code}" ${body_start} -1 body)
  string(STRIP "${body}" body)
  # Every ```cpp block of the document, compared whole with the example.
  set(rest "${text}")
  while(TRUE)
    string(FIND "${rest}" "```cpp\n" start)
    if(start EQUAL -1)
      break()
    endif()
    math(EXPR start "${start} + 7")
    string(SUBSTRING "${rest}" ${start} -1 rest)
    string(FIND "${rest}" "```" stop)
    if(stop EQUAL -1)
      message(FATAL_ERROR "${doc}: a ```cpp block is not closed")
    endif()
    string(SUBSTRING "${rest}" 0 ${stop} block)
    string(SUBSTRING "${rest}" ${stop} -1 rest)
    string(STRIP "${block}" block)
    if(block STREQUAL body)
      message(STATUS "${doc} shows ${example} verbatim")
      return()
    endif()
  endwhile()
  message(FATAL_ERROR "${doc} does not show ${example} verbatim in a ```cpp block: keep them identical")
endfunction()

expect_verbatim(README.md examples/minimal.cpp)
expect_verbatim(docs/policies.md examples/custom_policy.cpp)
expect_verbatim(docs/integration.md examples/paged_decode.cpp)
