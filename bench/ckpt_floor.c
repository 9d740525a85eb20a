/* A checked checkpoint load's bytes alone, with no Python: about what `hpcpar bench ckpt`'s load
 * would take if parsing the manifest, planning, checking the plans and assigning cost nothing.
 *
 * Two ranks, as `mpiexec -n 2 hpcpar bench ckpt`: each rank wrote one shard of MIB MiB and loads
 * both (a dp replica loads the whole model) into memory it already holds. Per round, each rank
 * times, the slowest rank counting:
 *   raw read  pread of both files into that memory (the bench's baseline);
 *   map+copy  mmap both files, copy them into that memory, unmap: a load that checks nothing;
 *   checked   the same, after a CRC-32 of this rank's half (its own file), as hpcpar's load
 *             splits the checking between replicas; hpcpar's own CRC and copy functions.
 * Medians over the rounds, in ms, and raw/this as the bench prints load/raw.
 *
 *   .venv/bin/mpicc -O2 bench/ckpt_floor.c -ldl -o /tmp/ckpt_floor
 *   .venv/bin/mpiexec -n 2 /tmp/ckpt_floor build/libhpcpar_crc.so [MIB=18.65] [ROUNDS=41] */
#include <dlfcn.h>
#include <fcntl.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef void (*copy_fn)(size_t, unsigned char *const *, const unsigned char *const *, const size_t *);
typedef uint32_t (*crc_fn)(uint32_t, const unsigned char *, size_t);

enum { RAW, MAP_COPY, CHECKED, MODES };
static const char *NAMES[MODES] = {"raw read", "map+copy", "checked"};

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void write_shard(const char *path, size_t n, int seed) {
    unsigned char *bytes = malloc(n);
    for (size_t i = 0; i < n; i++) bytes[i] = (unsigned char)(i * 7 + seed);
    FILE *f = fopen(path, "wb");
    fwrite(bytes, 1, n, f);
    fclose(f);
    free(bytes);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 2 || size != 2) {
        if (rank == 0) fprintf(stderr, "usage: mpiexec -n 2 %s LIBHPCPAR_CRC.so [MIB] [ROUNDS]\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    size_t n = (size_t)((argc > 2 ? atof(argv[2]) : 18.65) * 1048576) & ~(size_t)15;
    int rounds = argc > 3 ? atoi(argv[3]) : 41;
    void *lib = dlopen(argv[1], RTLD_NOW);
    copy_fn copy = lib ? (copy_fn)dlsym(lib, "hpcpar_copy_pieces") : NULL;
    crc_fn crc = lib ? (crc_fn)dlsym(lib, "hpcpar_crc32_blocks") : NULL;
    if (!copy || !crc) {
        fprintf(stderr, "%s: no hpcpar_copy_pieces / hpcpar_crc32_blocks\n", argv[1]);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    char dir[] = "/tmp/ckpt-floor-XXXXXX", path[2][64];
    if (rank == 0 && !mkdtemp(dir)) MPI_Abort(MPI_COMM_WORLD, 1);
    MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
    for (int k = 0; k < 2; k++) snprintf(path[k], sizeof path[k], "%s/shard-%d", dir, k);
    write_shard(path[rank], n, rank);
    MPI_Barrier(MPI_COMM_WORLD);

    unsigned char *held = malloc(2 * n);
    memset(held, 1, 2 * n);  /* memory the rank already holds, as the model's arrays */
    int fd[2] = {open(path[0], O_RDONLY), open(path[1], O_RDONLY)};
    double *times = malloc(sizeof(double) * MODES * rounds);
    volatile uint32_t sink = 0;
    for (int round = 0; round < rounds; round++) {
        for (int mode = 0; mode < MODES; mode++) {
            MPI_Barrier(MPI_COMM_WORLD);
            double start = seconds();
            if (mode == RAW) {
                for (int k = 0; k < 2; k++)
                    for (size_t got = 0; got < n;) got += pread(fd[k], held + k * n + got, n - got, got);
            } else {
                unsigned char *map[2];
                for (int k = 0; k < 2; k++) map[k] = mmap(NULL, n, PROT_READ, MAP_SHARED, fd[k], 0);
                if (mode == CHECKED) sink += crc(0, map[rank], n);
                unsigned char *dst[2] = {held, held + n};
                const unsigned char *src[2] = {map[0], map[1]};
                size_t len[2] = {n, n};
                copy(2, dst, src, len);
                for (int k = 0; k < 2; k++) munmap(map[k], n);
            }
            double mine = seconds() - start, slowest;
            MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            times[mode * rounds + round] = slowest;
        }
    }
    if (rank == 0) {
        printf("2 ranks, each loads %.2f MiB (two files of %.2f MiB), median of %d rounds\n",
               2 * n / 1048576.0, n / 1048576.0, rounds);
        double median[MODES];
        for (int mode = 0; mode < MODES; mode++) {
            qsort(times + mode * rounds, rounds, sizeof(double), by_value);
            median[mode] = times[mode * rounds + rounds / 2];
        }
        for (int mode = 0; mode < MODES; mode++)
            printf("%-9s %8.3f ms  raw/this %.3f\n", NAMES[mode], median[mode] * 1e3, median[RAW] / median[mode]);
    }
    close(fd[0]), close(fd[1]);
    unlink(path[rank]);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) rmdir(dir);
    MPI_Finalize();
    return sink == 0x5eed ? 3 : 0;  /* keeps the CRC from being optimised away */
}
