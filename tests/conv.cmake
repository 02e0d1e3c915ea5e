# Verified so far at 2 ranks only; the other decompositions are part of the
# remaining work on issue 3 (see tests/test_conv.cpp).
shardtensor_add_mpi_test(test_conv SOURCES test_conv.cpp RANKS 2)
