# Warnings for our own targets. CMAKE_COMPILE_WARNING_AS_ERROR (set from $CI by the
# presets) turns them into errors.
function(zo_set_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor
      -Wcast-align -Wunused -Woverloaded-virtual -Wimplicit-fallthrough>
    # nvcc 2810: "ignoring nodiscard return value" on a plain assignment of a [[nodiscard]] type.
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra --diag-suppress=2810>)
endfunction()
