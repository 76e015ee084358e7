# Installs the built project into a scratch prefix, runs the installed tools (they must find
# the installed libzoffload), then configures, builds and runs tests/install/consumer against
# it with find_package(zoffload).
file(REMOVE_RECURSE "${ZO_WORK_DIR}")
set(prefix "${ZO_WORK_DIR}/prefix")
function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}")
  endif()
  message(STATUS "${out}")
endfunction()
run(${CMAKE_COMMAND} --install "${ZO_BINARY_DIR}" --prefix "${prefix}")
run("${prefix}/bin/zoffload-report" --json)
run("${prefix}/bin/zoffload-bench" --help)
run(${CMAKE_COMMAND} -S "${ZO_CONSUMER_DIR}" -B "${ZO_WORK_DIR}/build" -G "${ZO_GENERATOR}"
    -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_CXX_COMPILER=${ZO_CXX_COMPILER})
run(${CMAKE_COMMAND} --build "${ZO_WORK_DIR}/build")
run("${ZO_WORK_DIR}/build/consumer")
