"""Training: the job file schema and its validation (the loop and its metrics build on it)."""
from .config import Job, JobError, load_job, parse_override, schema_table
from .validate import validate

__all__ = ["Job", "JobError", "load_job", "parse_override", "schema_table", "validate"]
