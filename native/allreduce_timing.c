/*
 * allreduce_timing.c - the timing loop shared by the allreduce_bench executable
 * and by Python (through libhpcpar_native.so and ctypes).  See the header.
 */
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE, sysconf, nanosleep */

#include "hpcpar_native.h"

#include <limits.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/*
 * Allocate a buffer the way NumPy does on Linux, so that C and mpi4py-on-NumPy
 * timings run on the same kind of memory: from 4 MiB up, NumPy advises the
 * kernel to back the buffer with transparent huge pages, and where THP is in
 * "madvise" mode that alone made its all-reduces of 8-64 MiB about 15-25% faster
 * than the same loop on plain malloc memory (2 and 4 ranks, MPICH 5).
 */
static void *alloc_like_numpy(size_t nbytes)
{
    char *buffer = malloc(nbytes);
#if defined(MADV_HUGEPAGE)
    const long page = sysconf(_SC_PAGESIZE);
    if (buffer != NULL && page > 0 && nbytes >= ((size_t)4 << 20)) {
        /* madvise wants a page-aligned start; the advice is only a hint, so errors are ignored. */
        const size_t offset = (size_t)page - (uintptr_t)buffer % (size_t)page;
        madvise(buffer + offset, nbytes - offset, MADV_HUGEPAGE);
    }
#endif
    return buffer;
}

/* True between MPI_Init and MPI_Finalize, the only time MPI calls are allowed. */
static int mpi_is_running(void)
{
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    return initialized && !finalized;
}

/*
 * Between two MPI_Test polls: give the core away the way hpcpar's Python waits do
 * (hpcpar/runtime/comm.py polite_pause): sched_yield for the first 2 ms of a wait, then
 * 50 us sleeps.  The same schedule on both sides is what makes the polled rows comparable.
 */
static void polite_pause(double waited)
{
    if (waited < 2e-3) {
        sched_yield();
    } else {
        const struct timespec pause = {0, 50000};
        nanosleep(&pause, NULL);
    }
}

/* One all-reduce as `call` says; returns the OR of the MPI error codes. */
static int one_allreduce(MPI_Comm comm, float *sendbuf, float *recvbuf, int count, int call, int polite)
{
    if (call == HPCPAR_CALL_OUT_OF_PLACE)
        return MPI_Allreduce(sendbuf, recvbuf, count, MPI_FLOAT, MPI_SUM, comm);
    if (call == HPCPAR_CALL_IN_PLACE)
        return MPI_Allreduce(MPI_IN_PLACE, recvbuf, count, MPI_FLOAT, MPI_SUM, comm);
    MPI_Request request;
    int failed = MPI_Iallreduce(MPI_IN_PLACE, recvbuf, count, MPI_FLOAT, MPI_SUM, comm, &request);
    if (failed != MPI_SUCCESS)
        return failed;
    const double start = MPI_Wtime();
    int done = 0;
    while (!done && failed == MPI_SUCCESS) {
        failed = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
        if (!done && polite)
            polite_pause(MPI_Wtime() - start);
    }
    return failed;
}

double hpcpar_time_allreduce_call_comm(MPI_Comm comm, size_t nbytes, int warmup, int iters, int call,
                                       int polite)
{
    if (!mpi_is_running() || comm == MPI_COMM_NULL || call < HPCPAR_CALL_OUT_OF_PLACE ||
        call > HPCPAR_CALL_POLLED_IN_PLACE)
        return HPCPAR_TIME_BAD_ARGS;

    /* mpi4py installs MPI_ERRORS_RETURN, so MPI errors come back as codes, not aborts. */
    int nranks;
    if (MPI_Comm_size(comm, &nranks) != MPI_SUCCESS)
        return HPCPAR_TIME_BAD_ARGS;

    /* MPI_Allreduce takes an int count of floats. */
    const size_t count = nbytes / sizeof(float);
    const int args_ok = nbytes > 0 && nbytes % sizeof(float) == 0 && count <= INT_MAX &&
                        warmup >= 0 && iters > 0;

    float *sendbuf = NULL, *recvbuf = NULL;
    if (args_ok) {
        sendbuf = alloc_like_numpy(nbytes);
        recvbuf = alloc_like_numpy(nbytes);
    }
    const int alloc_ok = sendbuf != NULL && recvbuf != NULL;

    /*
     * Agree on arguments and allocations before the first timed collective:
     * a rank that gave up alone would leave the others waiting forever.
     * Code 0 = fine, 1 = bad arguments, 2 = no memory; the worst one wins.
     */
    int status = !args_ok ? 1 : !alloc_ok ? 2 : 0;
    if (MPI_Allreduce(MPI_IN_PLACE, &status, 1, MPI_INT, MPI_MAX, comm) != MPI_SUCCESS)
        status = 3;
    if (status != 0) {
        free(sendbuf);
        free(recvbuf);
        return status == 1 ? HPCPAR_TIME_BAD_ARGS
               : status == 2 ? HPCPAR_TIME_NO_MEMORY
                             : HPCPAR_TIME_MPI_ERROR;
    }

    /*
     * Touch every page now so that first-touch page faults are not timed.  In place, the
     * buffer holds zeros while timed (a sum of ones would grow to infinity), and ones for
     * one more call that is checked.
     */
    const int in_place = call != HPCPAR_CALL_OUT_OF_PLACE;
    for (size_t i = 0; i < count; i++)
        sendbuf[i] = 1.0f;
    memset(recvbuf, 0, nbytes);

    int failed = 0; /* any MPI call that did not return MPI_SUCCESS */
    for (int i = 0; i < warmup; i++)
        failed |= one_allreduce(comm, sendbuf, recvbuf, (int)count, call, polite);

    /* Start together, then time back-to-back calls (no barrier inside the loop). */
    failed |= MPI_Barrier(comm);
    const double start = MPI_Wtime();
    for (int i = 0; i < iters; i++)
        failed |= one_allreduce(comm, sendbuf, recvbuf, (int)count, call, polite);
    const double mean = (MPI_Wtime() - start) / iters;

    if (in_place) {
        memcpy(recvbuf, sendbuf, nbytes);
        failed |= one_allreduce(comm, sendbuf, recvbuf, (int)count, call, polite);
    }
    /* A sum of nranks ones is exact in float whatever the reduction order. */
    int wrong = 0;
    for (size_t i = 0; i < count; i++)
        wrong |= recvbuf[i] != (float)nranks;
    free(sendbuf);
    free(recvbuf);

    /* One reduction gives the slowest rank's mean and whether any rank failed. */
    double result[3] = {mean, wrong ? 1.0 : 0.0, failed != MPI_SUCCESS ? 1.0 : 0.0};
    if (MPI_Allreduce(MPI_IN_PLACE, result, 3, MPI_DOUBLE, MPI_MAX, comm) != MPI_SUCCESS ||
        result[2] > 0.0)
        return HPCPAR_TIME_MPI_ERROR;
    return result[1] > 0.0 ? HPCPAR_TIME_WRONG_SUM : result[0];
}

double hpcpar_time_allreduce_comm(MPI_Comm comm, size_t nbytes, int warmup, int iters)
{
    return hpcpar_time_allreduce_call_comm(comm, nbytes, warmup, iters, HPCPAR_CALL_OUT_OF_PLACE, 0);
}

double hpcpar_time_allreduce_call(MPI_Fint comm_f, size_t nbytes, int warmup, int iters, int call,
                                  int polite)
{
    if (!mpi_is_running())
        return HPCPAR_TIME_BAD_ARGS;
    return hpcpar_time_allreduce_call_comm(MPI_Comm_f2c(comm_f), nbytes, warmup, iters, call, polite);
}

double hpcpar_time_allreduce(MPI_Fint comm_f, size_t nbytes, int warmup, int iters)
{
    /* MPI_Comm_f2c is only defined while MPI runs; check before converting. */
    if (!mpi_is_running())
        return HPCPAR_TIME_BAD_ARGS;
    return hpcpar_time_allreduce_comm(MPI_Comm_f2c(comm_f), nbytes, warmup, iters);
}
