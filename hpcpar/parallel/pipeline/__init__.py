"""Pipeline parallelism: schedules as data (``schedules``); the engine executes their actions."""
from .schedules import (SCHEDULES, Action, DeadlockError, ScheduleError, SimResult, format_grid, gpipe,
                        interleaved_1f1b, interleaved_fit, make_schedule, one_f_one_b, peak_activations, simulate,
                        theoretical_bubble, zero_bubble_h1)

__all__ = ["SCHEDULES", "Action", "DeadlockError", "ScheduleError", "SimResult", "format_grid", "gpipe",
           "interleaved_1f1b", "interleaved_fit", "make_schedule", "one_f_one_b", "peak_activations", "simulate",
           "theoretical_bubble", "zero_bubble_h1"]
from .engine import PipelineParallel
from .partition import PARTITION_METHODS, PartitionError, measure_layer_costs, partition
from .stages import Stages

__all__ += ["PipelineParallel", "PARTITION_METHODS", "PartitionError", "measure_layer_costs", "partition", "Stages"]
