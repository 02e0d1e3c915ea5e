# Run by tests/bench_smoke.cmake (cmake -P): two tiny benchmark runs at 2
# ranks into a fresh file, then parses it with string(JSON) and checks fields.
separate_arguments(_flags UNIX_COMMAND "${MPIEXEC_FLAGS}")
file(REMOVE "${OUT}")
foreach(args
    "run;--workload;unet2d;--mode;train;--shape;32,32;--steps;2;--warmup;1;--baseline-threads;1"
    "maxsize;--workload;conv_stack;--cap-mib;2;--start-size;16;--max-size;256")
  execute_process(COMMAND ${MPIEXEC} ${_flags} -np 2 ${BENCH} ${args} --scenario smoke --out ${OUT}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "shardtensor_bench ${args} failed (${rc})")
  endif()
endforeach()

file(READ "${OUT}" json)
string(JSON n ERROR_VARIABLE e LENGTH "${json}")
if(e OR NOT n EQUAL 2)
  message(FATAL_ERROR "expected a JSON array of 2 records in ${OUT}, got: ${e} ${n}\n${json}")
endif()
foreach(key workload mode ranks threads_per_rank mesh global_shape peak_bytes_per_rank
    baseline_peak_bytes memory_ratio step_s_median baseline_step_s_median baseline_threads
    speedup bytes_sent_per_rank comm_fraction)
  string(JSON v ERROR_VARIABLE e GET "${json}" 0 ${key})
  if(e)
    message(FATAL_ERROR "record 0 has no '${key}': ${e}")
  endif()
endforeach()
string(JSON ranks GET "${json}" 0 ranks)
string(JSON peak GET "${json}" 0 peak_bytes_per_rank)
string(JSON sent GET "${json}" 0 bytes_sent_per_rank)
string(JSON loss_diff GET "${json}" 0 loss_rel_diff)
if(NOT ranks EQUAL 2 OR NOT peak GREATER 0 OR NOT sent GREATER 0)
  message(FATAL_ERROR "implausible record: ranks ${ranks}, peak ${peak}, sent ${sent}")
endif()
# The sharded and single-process first-step losses agree (float32 sums re-associate).
if(loss_diff GREATER 1e-4)
  message(FATAL_ERROR "sharded and baseline losses differ: relative ${loss_diff}")
endif()
string(JSON max_size GET "${json}" 1 max_size)
string(JSON failing GET "${json}" 1 failing_size)
if(NOT max_size GREATER 0 OR NOT failing GREATER max_size)
  message(FATAL_ERROR "maxsize did not bracket the cap: ${max_size} / ${failing}")
endif()
message("bench_smoke: OK")
