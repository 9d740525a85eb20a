/*
 * allreduce_bench.c - OSU-style benchmark of raw MPI_Allreduce (MPI_FLOAT, MPI_SUM).
 *
 *   mpiexec -n 4 build/allreduce_bench            # table, 8 B .. 64 MiB in x2 steps
 *   mpiexec -n 4 build/allreduce_bench --csv      # the same as CSV
 *   mpiexec -n 2 build/allreduce_bench --quick    # few sizes, few iterations (CTest)
 *
 * For each size: warm-up calls, a barrier, a timed loop of back-to-back calls
 * (hpcpar_time_allreduce_comm in allreduce_timing.c, the same code Python
 * calls through libhpcpar_native.so).  Reported per size: bytes, iterations,
 * mean time per call in microseconds (the slowest rank's mean), and bus
 * bandwidth = bytes * 2(n-1)/n / time, the traffic each rank moves in a
 * ring all-reduce (NCCL-tests' definition), in GB/s (1e9 bytes/s).
 *
 * Iterations fall with the size (ITER_BYTES / bytes, between MIN_ITERS and
 * MAX_ITERS) and are further capped so that each size takes about
 * SECONDS_PER_SIZE, judged from a short probe; when even MIN_ITERS more calls
 * would overrun, the probe itself is reported.  With more ranks than cores, or
 * other jobs on them, one call can take 100x longer than with a core per rank.
 * --iters fixes the count for every size instead.
 *
 * Wait policy (--wait): MPICH spins while it waits, which starves the rank it
 * waits for when ranks outnumber cores; "auto" sleeps in the wait loop when
 * this node runs more ranks than it has CPUs, and spins otherwise.
 *
 * Exits 1 if a size failed (wrong sum, MPI error, no memory), 2 on bad arguments.
 */
#define _POSIX_C_SOURCE 200809L /* sysconf */

#include "hpcpar_native.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Iteration schedule: ITER_BYTES / bytes in [MIN_ITERS, MAX_ITERS], about SECONDS_PER_SIZE. */
enum { MAX_ITERS = 10000, MIN_ITERS = 2 };
static const size_t ITER_BYTES = (size_t)1 << 30; /* 1 GiB all-reduced per size */
static const double SECONDS_PER_SIZE = 0.6;

/* With --wait yield: polls without progress before each 1 us sleep (best measured here). */
enum { POLLS_BEFORE_SLEEP = 1 };

typedef enum { WAIT_AUTO, WAIT_SPIN, WAIT_YIELD } WaitPolicy;

typedef struct {
    size_t min_bytes, max_bytes, factor;
    long iters, warmup; /* < 0: from the schedule */
    WaitPolicy wait;
    int csv;
} Options;

static const char USAGE[] =
    "usage: allreduce_bench [--csv] [--quick] [--min-bytes N] [--max-bytes N]\n"
    "                       [--factor F] [--iters N] [--warmup N] [--wait auto|spin|yield]\n"
    "  --csv          machine-readable output: one header line, one row per size\n"
    "  --quick        few sizes (8 B .. 8 MiB, x16) and 10 iterations (smoke test);\n"
    "                 options after it override it\n"
    "  --min-bytes N  smallest message in bytes (default 8, a multiple of 4)\n"
    "  --max-bytes N  largest message in bytes (default 67108864 = 64 MiB)\n"
    "  --factor F     size step (default 2; 4 halves the number of sizes)\n"
    "  --iters N      timed iterations for every size (default: 1 GiB / size, at\n"
    "                 most 10000, fewer if a size would take over 0.6 s)\n"
    "  --warmup N     untimed warm-up iterations (default: iters/10, at least 1, with\n"
    "                 --iters; otherwise the probe that sizes the loop warms up)\n"
    "  --wait P       spin, or yield the core while waiting (default auto: yield\n"
    "                 when this node runs more ranks than it has CPUs)\n";

/* Parse a non-negative integer; 0 on success. */
static int parse_size(const char *text, size_t *out)
{
    char *end;
    errno = 0;
    const unsigned long long value = strtoull(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-')
        return -1;
    *out = (size_t)value;
    return 0;
}

/* Fill *opt from argv; returns the bad argument ("" for --help), or NULL. */
static const char *parse_options(int argc, char **argv, Options *opt)
{
    *opt = (Options){.min_bytes = 8, .max_bytes = (size_t)64 << 20, .factor = 2,
                     .iters = -1, .warmup = -1, .wait = WAIT_AUTO, .csv = 0};
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        size_t number = 0;
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0)
            return "";
        if (strcmp(arg, "--csv") == 0) {
            opt->csv = 1;
        } else if (strcmp(arg, "--quick") == 0) {
            opt->min_bytes = 8;
            opt->max_bytes = (size_t)8 << 20;
            opt->factor = 16;
            opt->iters = 10;
        } else if (strcmp(arg, "--wait") == 0 && value != NULL) {
            if (strcmp(value, "auto") == 0)
                opt->wait = WAIT_AUTO;
            else if (strcmp(value, "spin") == 0)
                opt->wait = WAIT_SPIN;
            else if (strcmp(value, "yield") == 0)
                opt->wait = WAIT_YIELD;
            else
                return "--wait (auto, spin or yield)";
            i++;
        } else if (value != NULL && parse_size(value, &number) == 0) {
            /* Every remaining option takes a number. */
            if ((strcmp(arg, "--iters") == 0 || strcmp(arg, "--warmup") == 0) &&
                number > 1000000000)
                return arg;
            if (strcmp(arg, "--min-bytes") == 0)
                opt->min_bytes = number;
            else if (strcmp(arg, "--max-bytes") == 0)
                opt->max_bytes = number;
            else if (strcmp(arg, "--factor") == 0)
                opt->factor = number;
            else if (strcmp(arg, "--iters") == 0)
                opt->iters = (long)number;
            else if (strcmp(arg, "--warmup") == 0)
                opt->warmup = (long)number;
            else
                return arg;
            i++;
        } else {
            return arg;
        }
    }
    if (opt->min_bytes == 0 || opt->min_bytes % sizeof(float) != 0)
        return "--min-bytes (must be a positive multiple of 4)";
    if (opt->max_bytes < opt->min_bytes)
        return "--max-bytes (must be >= --min-bytes)";
    if (opt->factor < 2)
        return "--factor (must be >= 2)";
    if (opt->iters == 0)
        return "--iters (must be at least 1)";
    return NULL;
}

/* Iterations allowed by the size schedule. */
static int scheduled_iterations(size_t nbytes)
{
    const size_t iters = ITER_BYTES / nbytes;
    return iters > MAX_ITERS ? MAX_ITERS : iters < MIN_ITERS ? MIN_ITERS : (int)iters;
}

/*
 * Time one size; returns seconds per call or a negative HPCPAR_TIME_* code.
 * *iters_used receives the number of timed calls.
 */
static double time_size(const Options *opt, size_t nbytes, int *iters_used)
{
    if (opt->iters > 0) { /* fixed count: plain warm-up, then the timed loop */
        *iters_used = (int)opt->iters;
        const int warmup = opt->warmup >= 0 ? (int)opt->warmup
                           : opt->iters / 10 > 1 ? (int)(opt->iters / 10) : 1;
        return hpcpar_time_allreduce_comm(MPI_COMM_WORLD, nbytes, warmup, *iters_used);
    }
    /* A short probe (also the warm-up) sets the budget; it is the slowest rank's time, so
       every rank picks the same count.  1% of the scheduled calls, to damp one slow call. */
    int iters = scheduled_iterations(nbytes);
    const int probe_iters = iters / 100 + 1;
    const double probe = hpcpar_time_allreduce_comm(MPI_COMM_WORLD, nbytes, 1, probe_iters);
    if (probe < 0 || probe * MIN_ITERS > SECONDS_PER_SIZE) { /* too slow to time again */
        *iters_used = probe_iters;
        return probe;
    }
    if (probe * iters > SECONDS_PER_SIZE)
        iters = (int)(SECONDS_PER_SIZE / probe);
    *iters_used = iters;
    return hpcpar_time_allreduce_comm(MPI_COMM_WORLD, nbytes,
                                      opt->warmup >= 0 ? (int)opt->warmup : 0, iters);
}

/*
 * Apply the wait policy; returns what is in effect ("spin", "yield", or
 * "default" when this MPI has no such control) and writes why into reason.
 */
static const char *apply_wait_policy(WaitPolicy wait, char *reason, size_t size)
{
    MPI_Comm node;
    int node_ranks;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &node_ranks);
    MPI_Comm_free(&node);
    const long cpus = sysconf(_SC_NPROCESSORS_ONLN);

    if (wait == WAIT_AUTO)
        wait = cpus > 0 && node_ranks > cpus ? WAIT_YIELD : WAIT_SPIN;
    snprintf(reason, size, "%d ranks on this node, %ld CPUs", node_ranks, cpus);
    if (hpcpar_set_wait_policy(wait == WAIT_YIELD ? POLLS_BEFORE_SLEEP : 0) != 0) {
        snprintf(reason, size, "this MPI has no wait-policy control; MPI's default");
        return "default";
    }
    return wait == WAIT_YIELD ? "yield" : "spin";
}

/* The first line of MPI_Get_library_version, e.g. "MPICH Version: 5.0.2". */
static void mpi_library_name(char name[MPI_MAX_LIBRARY_VERSION_STRING])
{
    int length = 0;
    MPI_Get_library_version(name, &length);
    name[strcspn(name, "\r\n")] = '\0';
    for (char *c = name; *c != '\0'; c++) /* tabs would break the header's alignment */
        if (*c == '\t')
            *c = ' ';
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, nranks;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    /* Every rank parses the same argv, so every rank takes the same branch. */
    Options opt;
    const char *bad = parse_options(argc, argv, &opt);
    if (bad != NULL) {
        if (rank == 0) {
            if (bad[0] != '\0')
                fprintf(stderr, "allreduce_bench: bad argument: %s\n", bad);
            fputs(USAGE, bad[0] != '\0' ? stderr : stdout);
        }
        MPI_Finalize();
        return bad[0] != '\0' ? 2 : 0;
    }

    char reason[128], library[MPI_MAX_LIBRARY_VERSION_STRING];
    const char *wait = apply_wait_policy(opt.wait, reason, sizeof reason);
    mpi_library_name(library);
    if (rank == 0) {
        if (opt.csv) {
            puts("ranks,wait,bytes,iters,avg_us,busbw_gbs");
        } else {
            printf("# hpcpar raw MPI_Allreduce benchmark (MPI_FLOAT, MPI_SUM)\n");
            printf("# ranks: %d   MPI: %s\n", nranks, library);
            printf("# wait: %s (%s)\n", wait, reason);
            printf("# avg_us: mean per call of the slowest rank; "
                   "busbw = bytes * 2(n-1)/n / time\n");
            printf("%12s %8s %14s %12s\n", "bytes", "iters", "avg_us", "busbw_GB/s");
        }
        fflush(stdout);
    }

    int failed = 0;
    const double sweep_start = MPI_Wtime();
    for (size_t nbytes = opt.min_bytes; nbytes <= opt.max_bytes; nbytes *= opt.factor) {
        int iters = 0;
        const double seconds = time_size(&opt, nbytes, &iters);
        if (seconds < 0) {
            if (rank == 0)
                fprintf(stderr, "allreduce_bench: %zu bytes: %s\n", nbytes,
                        seconds == HPCPAR_TIME_WRONG_SUM   ? "wrong sum received"
                        : seconds == HPCPAR_TIME_NO_MEMORY ? "out of memory"
                        : seconds == HPCPAR_TIME_MPI_ERROR ? "an MPI call failed"
                                                           : "bad arguments");
            failed = 1;
            break;
        }
        const double busbw = (double)nbytes * 2.0 * (nranks - 1) / nranks / seconds / 1e9;
        if (rank == 0) {
            if (opt.csv)
                printf("%d,%s,%zu,%d,%.3f,%.4f\n", nranks, wait, nbytes, iters, seconds * 1e6,
                       busbw);
            else
                printf("%12zu %8d %14.2f %12.3f\n", nbytes, iters, seconds * 1e6, busbw);
            fflush(stdout);
        }
        if (nbytes > opt.max_bytes / opt.factor) /* the next size would pass the maximum */
            break;
    }
    if (rank == 0 && !opt.csv)
        printf("# sweep: %.1f s\n", MPI_Wtime() - sweep_start);

    MPI_Finalize();
    return failed;
}
