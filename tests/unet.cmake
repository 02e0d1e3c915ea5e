shardtensor_add_mpi_test(test_unet SOURCES test_unet.cpp RANKS 1 2 3 4 MESH2X2)
target_include_directories(test_unet PRIVATE ${PROJECT_SOURCE_DIR}/examples)
