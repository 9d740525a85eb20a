/*
 * wait_policy.c - spin or sleep while waiting in MPI (see hpcpar_native.h).
 *
 * Set through the MPI tool interface (MPI_T) rather than environment
 * variables, because those are read once, in MPI_Init, and a Python process
 * has initialized MPI by the time it can call us.
 */
#include "hpcpar_native.h"

/* Write an int control variable by name; 0 on success, -1 if absent or not an int. */
static int write_int_cvar(const char *name, int value)
{
    int index, count, rc = -1;
    if (MPI_T_cvar_get_index(name, &index) != MPI_SUCCESS)
        return -1;

    MPI_Datatype datatype;
    MPI_T_enum enumtype;
    int verbosity, bind, scope;
    if (MPI_T_cvar_get_info(index, NULL, NULL, &verbosity, &datatype, &enumtype, NULL, NULL,
                            &bind, &scope) != MPI_SUCCESS ||
        datatype != MPI_INT || bind != MPI_T_BIND_NO_OBJECT)
        return -1;

    MPI_T_cvar_handle handle;
    if (MPI_T_cvar_handle_alloc(index, NULL, &handle, &count) != MPI_SUCCESS)
        return -1;
    if (count == 1 && MPI_T_cvar_write(handle, &value) == MPI_SUCCESS)
        rc = 0;
    MPI_T_cvar_handle_free(&handle);
    return rc;
}

int hpcpar_set_wait_policy(int polls_before_sleep)
{
    int provided;
    if (polls_before_sleep < 0 ||
        MPI_T_init_thread(MPI_THREAD_SINGLE, &provided) != MPI_SUCCESS)
        return -1;
    /* MPICH ch4: after N polls that made no progress, usleep(1).  The count is
       set first and may be missing (then MPICH's default of 4096 applies). */
    if (polls_before_sleep > 0)
        write_int_cvar("MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT", polls_before_sleep);
    const int rc = write_int_cvar("MPIR_CVAR_CH4_PROGRESS_THROTTLE", polls_before_sleep > 0);
    MPI_T_finalize();
    return rc;
}
