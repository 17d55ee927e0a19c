"""The scheduler and its Trio engine: app.server talks to Engine, Engine drives model's runner."""

from app.engine.engine import Draining, Engine, EngineConfig
from app.engine.request import Frame, GenerationParams, ThinkingBudget, Usage
from app.engine.scheduler import EngineError, Overloaded

__all__ = ["Draining", "Engine", "EngineConfig", "EngineError", "Frame", "GenerationParams", "Overloaded",
           "ThinkingBudget", "Usage"]
