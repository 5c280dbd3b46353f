# Warnings for meshrt's own targets (not for users of the package):
# meshrt_target_warnings(<target>...)
set(MESHRT_WARNING_FLAGS
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast -Wno-missing-field-initializers>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${MESHRT_WERROR}>>:-Werror>
  # CUDA sources: nvcc's own warnings, and the host compiler's on the host code it passes on.
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wshadow>
  $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${MESHRT_WERROR}>>:-Werror=all-warnings -Xcompiler=-Werror>)

function(meshrt_target_warnings)
  foreach(t ${ARGN})
    target_compile_options(${t} PRIVATE ${MESHRT_WARNING_FLAGS})
  endforeach()
endfunction()

if(MESHRT_SANITIZE)
  set(_flags "-fsanitize=${MESHRT_SANITIZE}" -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${_flags}>")
  add_link_options(${_flags})
endif()
