"""Cross-rank and cross-time differential analysis: records in, findings out.

Pure analysis on data frames: no Kafka, ClickHouse or HTTP in here.
"""

from .data import JobData, read_job
from .diagnose import Settings, diagnose
from .findings import CAUSES, Diagnosis, Finding

__all__ = ["CAUSES", "Diagnosis", "Finding", "JobData", "Settings", "diagnose", "read_job"]
