# Builds and runs tests/consumer/project against kvcompress, either installed (find_package) or as a
# subdirectory. Invoked by ctest: cmake -DMODE=... -DKVC_SOURCE=... -DWORK=... -P run.cmake
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()
set(common -DCMAKE_BUILD_TYPE=)  # the packaging is under test, not the optimiser: compile at -O0
if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} -S ${KVC_SOURCE} -B ${WORK}/kvc-build ${common} -DKVC_BUILD_TESTS=OFF
      -DKVC_BUILD_EXAMPLES=OFF -DKVC_BUILD_BENCH=OFF -DKVC_BUILD_PYTHON=OFF -DCMAKE_INSTALL_PREFIX=${WORK}/prefix)
  run(${CMAKE_COMMAND} --install ${WORK}/kvc-build)
  run(${CMAKE_COMMAND} -S ${KVC_SOURCE}/tests/consumer/project -B ${WORK}/build ${common}
      -DCMAKE_PREFIX_PATH=${WORK}/prefix -DKVC_CONSUMER_MODE=find_package)
else()
  run(${CMAKE_COMMAND} -S ${KVC_SOURCE}/tests/consumer/project -B ${WORK}/build ${common}
      -DKVC_CONSUMER_MODE=add_subdirectory -DKVC_SOURCE=${KVC_SOURCE})
endif()
run(${CMAKE_COMMAND} --build ${WORK}/build)
run(${WORK}/build/consumer)
message(STATUS "consumer (${MODE}) built and ran")
