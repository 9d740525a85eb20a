/*
 * hpcpar_native.h - the C API of libhpcpar_native.so, hpcpar's raw-MPI baseline.
 *
 * The library holds the one all-reduce timing loop (allreduce_timing.c) and the
 * wait-policy switch (wait_policy.c).  The standalone benchmark
 * (allreduce_bench.c) links against it, and Python (hpcpar/native.py) calls it
 * through ctypes inside the mpi4py processes, so both measure raw
 * MPI_Allreduce with exactly the same code and the same MPI library.
 */
#ifndef HPCPAR_NATIVE_H
#define HPCPAR_NATIVE_H

#include <stddef.h>
#include <mpi.h>

#if defined(MPI_ABI_VERSION)
#error "build against the MPI library's own ABI (mpicc), not the MPI 5 standard ABI (mpicc_abi): \
mpi4py's default MPICH variant loads libmpi.so.12, and the standard ABI has no MPI_Fint"
#endif

/* The library is built with hidden visibility; only these symbols are exported. */
#if defined(__GNUC__)
#define HPCPAR_API __attribute__((visibility("default")))
#else
#define HPCPAR_API
#endif

/*
 * Negative return values of the timing functions.  Every rank of the
 * communicator returns the same value: the ranks agree on errors before and
 * after the timed loop, so a failure on one rank never leaves the others
 * waiting in a collective.
 */
#define HPCPAR_TIME_BAD_ARGS (-1.0)   /* MPI not running, null comm, bad size or counts */
#define HPCPAR_TIME_NO_MEMORY (-2.0)  /* a rank could not allocate its two buffers */
#define HPCPAR_TIME_WRONG_SUM (-3.0)  /* a rank received a result other than the expected sum */
#define HPCPAR_TIME_MPI_ERROR (-4.0)  /* an MPI call returned an error (MPI_ERRORS_RETURN) */

/*
 * Time MPI_Allreduce(MPI_FLOAT, MPI_SUM) of nbytes (a positive multiple of
 * sizeof(float)) on comm.  Collective over comm.
 *
 * Runs `warmup` untimed calls, an MPI_Barrier, then `iters` back-to-back
 * timed calls.  Returns the mean seconds per call of the slowest rank (the
 * maximum over ranks of each rank's mean), or one of the negative codes above.
 * Every element sent is 1.0f, so every element received must be exactly the
 * communicator size; the result is checked after the loop.
 */
HPCPAR_API double hpcpar_time_allreduce_comm(MPI_Comm comm, size_t nbytes, int warmup,
                                             int iters);

/*
 * The same, taking the communicator as a Fortran handle so that Python can
 * pass mpi4py's `comm.py2f()` through ctypes.
 */
HPCPAR_API double hpcpar_time_allreduce(MPI_Fint comm_f, size_t nbytes, int warmup,
                                        int iters);

/* Which all-reduce hpcpar_time_allreduce_call times. */
#define HPCPAR_CALL_OUT_OF_PLACE 0    /* MPI_Allreduce(sendbuf, recvbuf, ...) */
#define HPCPAR_CALL_IN_PLACE 1        /* MPI_Allreduce(MPI_IN_PLACE, buf, ...) */
#define HPCPAR_CALL_POLLED_IN_PLACE 2 /* MPI_Iallreduce(MPI_IN_PLACE, buf, ...), then MPI_Test polls */

/*
 * Time one kind of all-reduce call (above), as hpcpar_time_allreduce_comm does.
 * polite != 0: between MPI_Test polls, sched_yield for the first 2 ms of a wait,
 * then sleep 50 us (hpcpar's "yield" wait policy); 0 spins.  In place, the timed
 * calls reduce zeros and one more call of ones is checked.
 */
HPCPAR_API double hpcpar_time_allreduce_call_comm(MPI_Comm comm, size_t nbytes, int warmup,
                                                  int iters, int call, int polite);

/* The same with a Fortran communicator handle (for ctypes). */
HPCPAR_API double hpcpar_time_allreduce_call(MPI_Fint comm_f, size_t nbytes, int warmup,
                                             int iters, int call, int polite);

/*
 * Choose how this process waits inside blocking MPI calls, from now on.
 *
 * MPICH busy-polls while it waits.  With more ranks than cores a spinning rank
 * holds a core that the rank it waits for needs, and an all-reduce of 512 KiB
 * on 4 ranks over 2 cores took 0.7 s instead of 5 ms.  polls_before_sleep > 0
 * sleeps 1 us after that many consecutive polls without progress (MPICH's
 * MPIR_CVAR_CH4_PROGRESS_THROTTLE, set through the MPI tool interface, so it
 * works after MPI_Init and from Python); 0 spins (MPICH's default).
 *
 * Local to the calling process.  Returns 0 when applied, -1 when this MPI
 * library has no such control (then nothing changed).
 */
HPCPAR_API int hpcpar_set_wait_policy(int polls_before_sleep);

#endif /* HPCPAR_NATIVE_H */
