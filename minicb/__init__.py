"""minicb: a course-sized LLM engine, from one request to continuous batching (see README.md)."""

from minicb.config import EngineConfig
from minicb.engine import Engine, SchedulerError
from minicb.llm import LLM
from minicb.request import RequestOutput, SamplingParams
from minicb.scheduler import ScheduledBatch, Scheduler, SchedulerContext
from minicb.trace import Member, StepRecord

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "Scheduler",
           "SchedulerContext", "ScheduledBatch", "SchedulerError", "StepRecord", "Member"]
__version__ = "0.1.0"
