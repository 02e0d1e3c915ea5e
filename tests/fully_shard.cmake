shardtensor_add_mpi_test(test_fully_shard SOURCES test_fully_shard.cpp RANKS 1 2 3 4)
target_include_directories(test_fully_shard PRIVATE ${PROJECT_SOURCE_DIR}/examples)
