# Serial tests of the spec layer (abstract meshes, no MPI launch).
shardtensor_add_serial_test(test_spec test_spec.cpp)
