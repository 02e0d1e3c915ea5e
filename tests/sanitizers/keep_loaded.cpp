// Linked into every test executable (tests/CMakeLists.txt); empty unless the
// tests are built with AddressSanitizer (`make test-asan`).
//
// Note [sanitizer keeps MPI components]: Open MPI loads its components
// (mca_*.so) with dlopen and unloads them again, some during MPI_Init (those
// not selected) and the rest in MPI_Finalize. Allocations they leave for the
// OS are then reported by LeakSanitizer at exit with "<unknown module>"
// frames, which no suppression can name (tests/sanitizers/lsan.supp names the
// MPI libraries). This definition in the executable, which comes first in
// symbol lookup, makes dlclose keep every library mapped, so those frames
// keep their module names and the MPI entries of lsan.supp match them. The
// library itself is unchanged.
#if defined(__SANITIZE_ADDRESS__)
extern "C" int dlclose(void*) { return 0; }
#endif
