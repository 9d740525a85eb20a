"""Training: the job file schema and its validation (the loop and its metrics build on it)."""
from .config import Job, JobError, schema_table
from .config_load import load_job, parse_override
from .validate import validate

__all__ = ["Job", "JobError", "load_job", "parse_override", "schema_table", "validate"]
