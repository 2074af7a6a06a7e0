"""minicb: a course-sized LLM inference engine, from one request at a time to continuous
batching with chunked prefill and PD interleaving. See README.md for the course map."""

from minicb.config import EngineConfig
from minicb.engine import Engine, SchedulerError
from minicb.llm import LLM
from minicb.request import RequestOutput, SamplingParams
from minicb.scheduler import ScheduledBatch, Scheduler, SchedulerContext
from minicb.trace import Member, StepRecord

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "Scheduler",
           "SchedulerContext", "ScheduledBatch", "SchedulerError", "StepRecord", "Member"]
__version__ = "0.1.0"
