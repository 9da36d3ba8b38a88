/* Input of the committed bindings in src/ffi.rs (see its header for the command). */
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>
