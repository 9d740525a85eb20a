"""The MPI runtime: parallel context, counted array communication, fail-fast, debug checks."""
from .comm import Communicator, Handle, wait_all
from .device_transport import query_cuda_aware
from .stats import CommStats
from .context import LayoutError, ParallelContext, format_grid, init, resolve_layout, single_process
from .debug import CollectiveMismatchError
from .failfast import fail_fast, install as install_fail_fast

__all__ = ["Communicator", "CommStats", "Handle", "query_cuda_aware", "wait_all", "LayoutError",
           "ParallelContext", "format_grid", "init", "resolve_layout", "single_process",
           "CollectiveMismatchError", "fail_fast", "install_fail_fast"]
